"""The accounting service is configured like JupyterHub's services: traits with help, a config file,
`--generate-config`, aliases, and the environment variables only as documented fallbacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.hub.services.accounting_service import AccountingService, config_reference
from gpupool.policies import DEFAULT_POLICY_DIR, defaults

DOC = Path(__file__).resolve().parents[3] / "docs" / "accounting-service.md"
ENVIRONMENT = ("GPUPOOL_STATE_DIR", "GPUPOOL_LEDGER_URL", "GPUPOOL_POLICIES", "GPUPOOL_TEAM_ROOT",
               "GPUPOOL_NAV_SERVICES", "GPUPOOL_RECONCILE_SECONDS", "GPUPOOL_RECONCILE_STALE_SECONDS",
               "JUPYTERHUB_SERVICE_URL", "JUPYTERHUB_SERVICE_PREFIX", "JUPYTERHUB_BASE_URL", "JUPYTERHUB_API_URL")


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def configured(argv=()) -> AccountingService:
    service = AccountingService()
    service.initialize(list(argv))
    return service


def test_every_setting_has_help_that_names_its_fallback():
    traits = AccountingService.class_own_traits(config=True)
    assert len(traits) >= 12
    for name, trait in traits.items():
        assert len(trait.help.split()) >= 8, name
        if name not in ("config_file", "generate_config"):
            assert "Default:" in trait.help, name


def test_without_settings_the_platform_defaults(clean, tmp_path):
    service = configured()
    state = tmp_path / "state"
    assert service.state_dir == str(state)
    assert service.ledger_url == defaults.ledger_url(state)
    assert service.team_root == str(defaults.team_root(state))
    assert service.policy_dir == str(DEFAULT_POLICY_DIR)
    assert service.nav_services == ["accounting"]
    assert (service.reconcile_seconds, service.reconcile_stale_seconds) == (60, 300)
    assert (service.service_url, service.service_prefix, service.hub_base_url, service.hub_api_url) == (
        "http://127.0.0.1:8003", "/services/accounting/", "/", "")


def test_the_environment_is_the_fallback_and_the_command_line_wins(clean, tmp_path):
    clean.setenv("GPUPOOL_STATE_DIR", str(tmp_path / "s"))
    clean.setenv("GPUPOOL_NAV_SERVICES", "accounting,mlflow")
    clean.setenv("GPUPOOL_RECONCILE_SECONDS", "1")
    clean.setenv("JUPYTERHUB_SERVICE_PREFIX", "/x/services/accounting/")
    service = configured()
    assert service.ledger_url == defaults.ledger_url(tmp_path / "s")
    assert service.nav_services == ["accounting", "mlflow"]
    assert service.reconcile_seconds == 1.0 and service.service_prefix == "/x/services/accounting/"
    clean.setenv("GPUPOOL_LEDGER_URL", "postgresql+psycopg://env@db/gpupool")
    assert configured().ledger_url == "postgresql+psycopg://env@db/gpupool"
    service = configured(["--ledger-url", "postgresql+psycopg://cli@db/gpupool", "--reconcile-seconds=5",
                          "--team-root", "/srv/teams"])
    assert (service.ledger_url, service.reconcile_seconds, service.team_root) == (
        "postgresql+psycopg://cli@db/gpupool", 5.0, "/srv/teams")


def test_a_config_file_and_the_command_line_over_it(clean, tmp_path):
    config = tmp_path / "accounting_config.py"
    config.write_text("c.AccountingService.ledger_url = 'sqlite:////file/ledger.sqlite'\n"
                      "c.AccountingService.reconcile_stale_seconds = 42\n")
    clean.setenv("GPUPOOL_LEDGER_URL", "postgresql+psycopg://env@db/gpupool")
    service = configured(["--config", str(config)])
    assert (service.ledger_url, service.reconcile_stale_seconds) == ("sqlite:////file/ledger.sqlite", 42)
    service = configured(["--config", str(config), "--reconcile-stale-seconds", "7"])
    assert (service.ledger_url, service.reconcile_stale_seconds) == ("sqlite:////file/ledger.sqlite", 7)


def test_generate_config_prints_every_setting(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gpupool.hub.services.accounting_service", "--generate-config"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in AccountingService.class_own_traits(config=True):
        assert f"# c.AccountingService.{name} = " in done.stdout, name
    # the printed file is a config file the service loads
    (tmp_path / "accounting_config.py").write_text(done.stdout)
    service = AccountingService()
    service.initialize(["--config", str(tmp_path / "accounting_config.py")])


def test_the_configuration_reference_in_the_docs_is_current():
    text = DOC.read_text()
    start = text.index("<!-- accounting-reference:start")
    body = text[text.index("\n", start) + 1: text.index("<!-- accounting-reference:end -->")]
    assert body == config_reference() + "\n", "regenerate with gpupool.hub.services.accounting_service.config_reference()"

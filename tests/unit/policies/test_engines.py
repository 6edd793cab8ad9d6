"""`settings.engine` (issue 37): the share backends each Kubernetes engine cannot place are refused by `gpupool
policy check` when the policy names its engine (or `--kubernetes` asks), and only noted for a policy that names
none, which the embedded mode (no engine) runs as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpupool.hub.cli import main
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, PolicyError, load_policy
from gpupool.policies.engines import engine_named, refusals

#: One model offering every backend, so that a profile may name any of them.
MODEL = {"vendor": "nvidia", "memory_gib": 80, "product": "NVIDIA-A100-SXM4-80GB",
         "backends": ["hami", "volcano-vgpu", "mig", "timeslice", "whole"],
         "mig": {"strategy": "single", "profiles": ["1g.10gb"]}, "timeslice": {"replicas": 4}}
GPUS = {
    "hami": {"model": "A100", "share": 0.5, "backend": "hami"},
    "volcano-vgpu": {"model": "A100", "share": 0.25, "backend": "volcano-vgpu"},
    "mig": {"model": "A100", "mig": "1g.10gb"},
    "timeslice": {"model": "A100", "share": 0.25, "backend": "timeslice"},
    "whole": {"model": "A100", "count": 1},
}


def policy_dir(tmp_path: Path, backends: list[str], engine: str | None = None) -> Path:
    """A policy of one team with a profile per backend of `backends` (`p-<backend>`), naming `engine` if given."""
    directory = tmp_path / "policies"
    directory.mkdir(parents=True)
    cluster = {"models": {"A100": MODEL}}
    if engine is not None:
        cluster["settings"] = {"engine": engine}
    (directory / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (directory / "teams.yaml").write_text(yaml.safe_dump({"teams": {"vision": {"priority": 10}}}))
    profiles = {f"p-{b}": {"display_name": b, "gpu": GPUS[b], "teams": ["vision"]} for b in backends}
    profiles["cpu"] = {"display_name": "CPU", "teams": ["vision"]}
    (directory / "profiles.yaml").write_text(yaml.safe_dump({"profiles": profiles}))
    return directory


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["policy", "check", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_engine_is_volcano_unless_named_and_nothing_else_is_accepted(tmp_path):
    policy = load_policy(DEFAULT_POLICY_DIR)
    assert policy.settings.engine == "volcano" and not engine_named(policy)
    assert engine_named(load_policy(policy_dir(tmp_path, ["whole"], "volcano")))
    directory = policy_dir(tmp_path / "other", ["whole"], "kueue")
    with pytest.raises(PolicyError) as raised:
        load_policy(directory)
    assert "settings.engine" in str(raised.value) and "'volcano' or 'yunikorn'" in str(raised.value)


@pytest.mark.parametrize("directory", [DEFAULT_POLICY_DIR, EXAMPLES_DIR], ids=["default", "examples"])
def test_the_shipped_policies_name_no_engine_and_stay_valid_with_a_note(directory, capsys):
    # The embedded mode (`make up`) runs them with HAMi's shares: the check passes and says what the Kubernetes
    # mode under Volcano would refuse.
    code, out, err = check(capsys, str(directory))
    assert code == 0 and out.startswith("OK ")
    assert "cannot work in the Kubernetes mode under settings.engine 'volcano'" in err
    assert "h200-quarter" in err and "--kubernetes" in err


def test_the_kubernetes_check_refuses_hami_under_volcano_by_name_reason_and_alternatives(capsys):
    code, out, err = check(capsys, "--kubernetes", str(DEFAULT_POLICY_DIR))
    assert code == 1 and out == ""
    line = next(line for line in err.splitlines() if "profiles.h200-quarter:" in line)
    assert "backend 'hami' (model H200) cannot work under settings.engine 'volcano'" in line
    assert "HAMi's own scheduler" in line and "stays Pending" in line
    # the H200 offers hami and whole cards only: the fractional backends Volcano places are to be added to it
    assert line.endswith("add volcano-vgpu or timeslice to models.H200.backends")
    assert "nothing was changed" in err


@pytest.mark.parametrize("engine, refused, kept, instead", [
    ("volcano", ["hami"], ["volcano-vgpu", "mig", "timeslice", "whole"], "volcano-vgpu or timeslice"),
    ("yunikorn", ["hami", "volcano-vgpu"], ["mig", "timeslice", "whole"], "timeslice"),
])
def test_a_named_engine_refuses_each_backend_it_cannot_place_and_accepts_the_others(
        engine, refused, kept, instead, tmp_path, capsys):
    directory = policy_dir(tmp_path, refused + kept, engine)
    assert [(r.profile, r.backend) for r in refusals(load_policy(directory))] == [(f"p-{b}", b) for b in refused]
    code, out, err = check(capsys, str(directory))
    assert code == 1 and out == ""
    for backend in refused:
        line = next(line for line in err.splitlines() if f"profiles.p-{backend}:" in line)
        assert f"backend {backend!r} (model A100) cannot work under settings.engine {engine!r}" in line
        # the refused profiles ask for a fraction: only the fractional backends the engine places are offered
        assert f"give this profile {instead} (a backend for this request that its model offers)" in line
    # a volcano-vgpu share works under the other engine, a HAMi one under neither: only the first is pointed there
    if engine == "yunikorn":
        assert "choose settings.engine 'volcano'" in next(line for line in err.splitlines() if "p-volcano-vgpu" in line)
        assert "choose settings.engine" not in next(line for line in err.splitlines() if "p-hami:" in line)
    for backend in kept:
        assert f"p-{backend}:" not in err

    accepted = policy_dir(tmp_path / "accepted", kept, engine)
    code, out, err = check(capsys, "--kubernetes", str(accepted))
    assert (code, err) == (0, "") and out.startswith("OK ")


def test_a_share_whose_only_backend_is_refused_is_refused_without_naming_it(tmp_path, capsys):
    # The H200 of the shipped policies offers one fractional backend, HAMi's: the profile's share resolves to it.
    directory = policy_dir(tmp_path, [], "yunikorn")
    cluster = yaml.safe_load((directory / "cluster.yaml").read_text())
    cluster["models"]["A100"]["backends"] = ["hami", "whole"]
    (directory / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    profiles = yaml.safe_load((directory / "profiles.yaml").read_text())
    profiles["profiles"]["half"] = {"display_name": "half", "gpu": {"model": "A100", "share": 0.5},
                                    "teams": ["vision"]}
    (directory / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    code, _, err = check(capsys, str(directory))
    assert code == 1 and "profiles.half: backend 'hami' (model A100)" in err
    # whole cards or MIG slices are no answer to a half card: the backend to add to the model is named
    line = next(line for line in err.splitlines() if "profiles.half:" in line)
    assert line.endswith("model A100 offers no backend for this request that works under 'yunikorn': add "
                         "timeslice to models.A100.backends"), line
    assert "give this profile" not in line


def test_a_whole_card_on_hami_is_pointed_at_whole_cards_only(tmp_path, capsys):
    directory = policy_dir(tmp_path, [], "volcano")
    profiles = yaml.safe_load((directory / "profiles.yaml").read_text())
    profiles["profiles"]["one"] = {"display_name": "one", "gpu": {"model": "A100", "count": 1, "backend": "hami"},
                                   "teams": ["vision"]}
    (directory / "profiles.yaml").write_text(yaml.safe_dump(profiles))
    code, _, err = check(capsys, str(directory))
    line = next(line for line in err.splitlines() if "profiles.one:" in line)
    assert code == 1 and "give this profile whole (a backend for this request that its model offers)" in line

"""The spawner contract JupyterHub's users rely on, checked on `LocalGPUSpawner` itself (a real process, the
real pool and ledger): configured `options_from_form`, exit status and reaping, how a direct stop is booked,
and which profiles get the queue timeout added to `start_timeout`.

The whole of JupyterHub's own spawner suite runs in tests/e2e/test_jupyterhub_contract.py; these are the four
defects it found, each small and fast.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.user import User
from sqlalchemy.orm import object_session
from tornado import web
from traitlets.config import Config

from gpupool.hub.accounting.ledger import Ledger
from gpupool.spawner.local import LocalGPUSpawner

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, whole]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {priority: 100, quota: {gpus: 1, per_user_gpus: 1}}\n",
    "profiles.yaml": "profiles:\n"
                     "  cpu: {display_name: CPU only, teams: [vision], default: true}\n"
                     "  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision]}\n",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}


@pytest.fixture
def make_spawner(tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    for name, text in POLICY.items():
        (policies / name).write_text(text)
    db = orm.new_session_factory("sqlite://")()
    alice = orm.User(name="alice")
    alice.groups.append(orm.Group(name="vision"))  # the hub group of the user's team
    db.add(alice)
    db.commit()
    user = User(alice, {})
    made = []

    def make(code: str, **traits) -> LocalGPUSpawner:
        traits = {"cmd": [sys.executable, "-c", code], "hub": Hub(), "notebook_dir": str(tmp_path),
                  "oauth_client_id": "mock-client-id", "interrupt_timeout": 5, "term_timeout": 5, "kill_timeout": 5,
                  "run_as": "self", "state_dir": str(tmp_path / "state"), "policy_dir": str(policies), **traits}
        spawner = user._new_spawner("", spawner_class=LocalGPUSpawner, **traits)
        made.append(spawner)
        return spawner

    yield make
    for spawner in made:
        if spawner.proc is not None and spawner.proc.poll() is None:
            spawner.proc.kill()
            spawner.proc.wait()


def test_configured_options_from_form_is_not_shadowed():
    default = LocalGPUSpawner()
    assert default.run_options_from_form({"profile": ["cpu"], "image-cpu": ["base"]}) == {"profile": "cpu",
                                                                                        "image": "base"}
    config = Config()
    config.LocalGPUSpawner.options_from_form = "simple"
    simple = LocalGPUSpawner(config=config)
    assert simple.run_options_from_form({"profile": ["cpu"], "gpu": ["on"]}) == {"profile": "cpu", "gpu": True}

    def own(formdata, spawner):
        return {"profile": formdata["which"][0], "seen": spawner is configured}

    config.LocalGPUSpawner.options_from_form = own
    configured = LocalGPUSpawner(config=config)
    assert configured.run_options_from_form({"which": ["cpu"]}) == {"profile": "cpu", "seen": True}


@pytest.mark.asyncio
async def test_poll_gives_the_exit_status_and_reaps_the_server(make_spawner):
    spawner = make_spawner("import sys; sys.stdin.close(); sys.exit(3)", user_options={"profile": "h200-quarter"})
    await spawner.start()
    pid = spawner.pid
    status = None
    for _ in range(600):  # until the process has ended (it exits at once)
        status = await spawner.poll()
        if status is not None:
            break
        await asyncio.sleep(0.05)
    assert status == 3, "the exit status as Popen gives it, as JupyterHub's stock spawner returns it"
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # already reaped: no zombie left until the next poll
    assert spawner.pool.store.get("alice/") is None


@pytest.mark.asyncio
async def test_a_direct_stop_is_booked_as_stopped(make_spawner):
    spawner = make_spawner("import time; time.sleep(600)", user_options={"profile": "h200-quarter"})
    spawner._apply_choice(spawner, spawner.user_options)
    await spawner.start()
    run = spawner.usage_run
    assert run and await spawner.poll() is None
    await spawner.stop()  # called directly, not through the hub's stop handler
    (interval,) = Ledger(spawner.ledger_url, migrate=False).run_intervals(run)
    assert interval.how == "stopped"
    assert spawner.pool.store.get("alice/") is None


def test_only_profiles_that_can_queue_get_the_queue_timeout(make_spawner):
    cpu = make_spawner("pass", start_timeout=60)
    cpu._apply_choice(cpu, {"profile": "cpu"})
    assert cpu.start_timeout == 60, "a CPU profile never waits in the queue"
    gpu = make_spawner("pass", start_timeout=60)
    gpu._apply_choice(gpu, {"profile": "h200-quarter"})
    assert gpu.start_timeout == 60 + 3600, "a GPU share may wait up to the queue timeout first"


def test_refused_user_options_are_not_kept(make_spawner):
    spawner = make_spawner("pass")
    orm_spawner = spawner.orm_spawner
    spawner._apply_choice(spawner, {"profile": "h200-quarter"})
    # JupyterHub stores the raw options before it hands them over, and commits them.
    orm_spawner.user_options = {"profile": "x" * 200_000, "gpus": 8}
    object_session(orm_spawner).commit()
    with pytest.raises(web.HTTPError) as refused:
        spawner._apply_choice(spawner, orm_spawner.user_options)
    assert refused.value.status_code == 400 and len(refused.value.log_message) < 300
    object_session(orm_spawner).expire_all()
    assert orm_spawner.user_options == {"profile": "h200-quarter", "team": "vision"}, "the last choice that passed"


def test_values_from_a_request_are_cut_in_errors():
    from gpupool.policies import DEFAULT_POLICY_DIR, load_policy
    from gpupool.policies.choice import ChoiceRefused, check_choice

    policy = load_policy(DEFAULT_POLICY_DIR)
    team = next(iter(policy.teams))
    for options in ({"profile": "p" * 200_000}, {"k" * 200_000: 1}, {"profile": None, "team": "t" * 200_000}):
        with pytest.raises(ChoiceRefused) as refused:
            check_choice(policy, "alice", [team], options)
        assert not refused.value.forbidden and len(refused.value.message) < 400, options.keys()


def test_a_rejected_policy_is_logged_once_per_content(tmp_path, caplog):
    import logging

    from gpupool.policies.reload import current_policy

    for name, text in POLICY.items():
        (tmp_path / name).write_text(text)
    log = logging.getLogger("test-policy")
    good = current_policy(tmp_path, log)
    broken = tmp_path / "teams.yaml"
    for n in range(5):  # saved again and again with the same mistake, read many times
        broken.write_text("teams:\n  vision: {priority: high}\n")
        later = time.time_ns() + (n + 1) * 10**9  # a new modification time each save, as an editor gives
        os.utime(broken, ns=(later, later))
        for _ in range(3):
            assert current_policy(tmp_path, log) is good
    broken.write_text("teams:\n  vision: {priority: -1, quota: 5}\n")  # another mistake
    assert current_policy(tmp_path, log) is good
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 2, [r.getMessage()[:80] for r in rejected]

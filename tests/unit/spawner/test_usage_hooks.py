"""The spawners' shared ledger hooks (`gpupool.spawner.usage`), on a spawner object of its own and a real ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction

from prometheus_client import REGISTRY

from gpupool.hub.accounting.ledger import HowEnded, Ledger, run_key
from gpupool.policies import periods
from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.local import LocalGPUSpawner


class UserDouble:
    """A test double of JupyterHub's User wrapper: only the name and groups the mixin reads."""

    def __init__(self, name, groups):
        self.name = name
        self.groups = [type("Group", (), {"name": g})() for g in groups]
        self.url = f"/user/{name}/"


class OrmSpawnerDouble:
    """A test double of JupyterHub's orm.Spawner: the `started` time the hub sets, and the options it keeps."""

    def __init__(self, started: datetime):
        self.started = started  # naive UTC, as the hub keeps it
        self.user_options = None
        self.server = None  # what the Spawner base class reads from it
        self.name = ""  # the default server


def spawner_with(tmp_path, started: datetime, ledger_url: str | None = None) -> LocalGPUSpawner:
    spawner = LocalGPUSpawner(policy_dir=str(DEFAULT_POLICY_DIR), state_dir=str(tmp_path),
                              ledger_url=ledger_url or f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    spawner.user = UserDouble("alice", ["vision"])
    spawner.orm_spawner = OrmSpawnerDouble(started)
    spawner._apply_choice(spawner, {"profile": "h200-quarter"})
    return spawner


def test_open_see_close_write_one_run_under_the_hubs_key(tmp_path, monkeypatch):
    started = datetime(2026, 11, 3, 10, 0, 0, 250000)
    clock = [datetime(2026, 11, 3, 10, 0, 5, tzinfo=UTC)]
    monkeypatch.setattr(periods, "utcnow", lambda: clock[0])
    spawner = spawner_with(tmp_path, started)
    assert spawner.orm_spawner.user_options == {"profile": "h200-quarter", "team": "vision", "image": "base"}

    spawner.open_usage(timedelta(seconds=3))
    assert spawner.usage_run == run_key("alice", "", started) == "alice/@2026-11-03T10:00:00.250000Z"
    clock[0] += timedelta(seconds=30)
    spawner.see_usage()
    state = spawner.get_state()
    assert state["usage_run"] == spawner.usage_run

    restarted = spawner_with(tmp_path, started)  # the hub restarted: the run comes back from the state
    restarted.load_state(state)
    clock[0] += timedelta(seconds=30)
    restarted.close_usage(HowEnded.STOPPED)
    assert restarted.usage_run is None

    ledger = Ledger(restarted.ledger_url, migrate=False)
    (interval,) = [i for i in ledger.usage_rows("2026-11")]
    assert (interval.team, interval.profile, interval.model) == ("vision", "h200-quarter", "H200")
    assert interval.gpu_hours == Fraction(1, 4) * Fraction(60, 3600)
    assert ledger.queue_waits("2026-11")["vision"].longest_s == 3


def test_a_failed_ledger_write_is_counted_and_the_server_goes_on(tmp_path):
    def errors() -> float:
        return REGISTRY.get_sample_value("gpupool_ledger_write_errors_total", {"operation": "open"}) or 0

    before = errors()
    spawner = spawner_with(tmp_path, datetime(2026, 11, 3, 10), ledger_url="postgresql://nobody@127.0.0.1:1/none")
    spawner.open_usage()  # no database answers there: logged and counted, not raised
    assert errors() == before + 1

"""Crashes of the hub and of the accounting service mid-usage lose no GPU-second and count none twice.

A real `gpupool up` hub runs the accounting service and a real JupyterLab server holding 0.25 of an H200.
The service is killed with SIGKILL (the hub starts it again), then the hub (its services end with it; the server
runs on, as it does when a hub crashes), the hub is restarted, and the ledger is compared with the time the
server process really ran, within the heartbeat granularity (the spawner's poll and the service's reconciliation run every second here). Once on SQLite,
once on a real PostgreSQL.
"""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime
from fractions import Fraction

import psutil
import pytest
import sqlalchemy as sa

from gpupool.hub.accounting.ledger import INTERVALS, Ledger, _interval
from harness import Hub
from gpupool.spawner.pool import process_alive

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [alice, bob]}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision]}
billing: {prices: {H200: '3.20'}}
""",
}
#: Heartbeats every second (the spawner's poll), reconciliation every second, stale after 6 s.
FAST = """
c.LocalGPUSpawner.run_as = "self"
c.Spawner.poll_interval = 1
for service in c.JupyterHub.services:
    if service["name"] == "accounting":
        service["environment"].update({"GPUPOOL_RECONCILE_SECONDS": "1", "GPUPOOL_RECONCILE_STALE_SECONDS": "6"})
"""
#: What one heartbeat period and the start of a process can put between the ledger and the wall clock.
GRANULARITY_S = 4


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def hub(request, tmp_path):
    ledger_url = None
    if request.param == "postgresql":
        ledger_url = request.getfixturevalue("postgres_server").create_database("restart")
    hub = Hub(tmp_path, POLICY, FAST, ledger_url=ledger_url, mlflow=False)
    hub.start()
    yield hub
    hub.stop()
    for process in psutil.process_iter(["cmdline"]):  # no server or service outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []) or _is_service_of(process, hub):
            process.kill()


def _is_service_of(process: psutil.Process, hub: Hub) -> bool:
    try:
        return ("gpupool.hub.services.accounting_service" in " ".join(process.cmdline())
                and "gpupool.hub.lifecycle" not in process.cmdline()  # its supervisor
                and process.environ().get("GPUPOOL_STATE_DIR") == str(hub.state))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def accounting_service(hub: Hub) -> psutil.Process:
    (service,) = [p for p in psutil.process_iter() if _is_service_of(p, hub)]
    return service


def server_process(hub: Hub, user: str) -> psutil.Process:
    (process,) = [p for p in psutil.process_iter(["cmdline"])
                  if "jupyterhub-singleuser" in " ".join(p.info["cmdline"] or [])
                  and p.environ().get("JUPYTERHUB_USER") == user and str(hub.state) in p.environ().get("HOME", "")]
    return process


def runs_of(ledger_url: str, user: str) -> list:
    ledger = Ledger(ledger_url, migrate=False)
    try:
        with ledger.engine.connect() as connection:
            return [_interval(r) for r in connection.execute(
                sa.select(INTERVALS).where(INTERVALS.c.user == user).order_by(INTERVALS.c.start_at, INTERVALS.c.id))]
    finally:
        ledger.dispose()


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(what)


def assert_contiguous_and_once(pieces) -> int:
    """One run, its pieces back to back (no gap, no overlap); the seconds they add up to."""
    assert len({p.run for p in pieces}) == 1 and pieces[0].run is not None, [p.key for p in pieces]
    for before, after in zip(pieces, pieces[1:]):
        assert after.start == before.end, f"{before.key} ends {before.end}, {after.key} starts {after.start}"
    return sum(int((p.end - p.start).total_seconds()) for p in pieces)


def test_hub_and_service_killed_mid_usage(hub):
    hub.add_user("alice", "vision")
    assert hub.api("POST", "/users/alice/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
    hub.wait_ready("alice")
    ready = datetime.now(UTC)  # the run is billed by then (from its start)
    process = server_process(hub, "alice")
    began = datetime.fromtimestamp(process.create_time(), UTC)
    run = wait_for(lambda: runs_of(hub.ledger_url, "alice"), what="the spawner's interval")[0].run
    time.sleep(3)

    # The service crashes, and the hub starts it again.
    crashed = accounting_service(hub)
    crashed.send_signal(signal.SIGKILL)
    wait_for(lambda: [p for p in psutil.process_iter() if _is_service_of(p, hub) and p.pid != crashed.pid], 60,
             "the hub starting the service again")
    # Then the hub crashes: its services end with it, and nobody writes the ledger until it is back.
    service = accounting_service(hub)
    hub.kill()
    wait_for(lambda: not process_alive(service.pid, service.create_time()), 60,
             "the service ending with its hub")
    time.sleep(2)
    assert process.is_running(), "the server runs on while the hub is down"
    hub.start()
    hub.wait_ready("alice")
    wait_for(lambda: runs_of(hub.ledger_url, "alice")[-1].is_open, 30, "the run continued")
    time.sleep(3)
    asked_to_stop = datetime.now(UTC)  # still billed then (until the stop)
    hub.stop_server("alice")
    wait_for(lambda: not process.is_running(), 30, "the server process ending")
    ended = datetime.now(UTC)

    pieces = runs_of(hub.ledger_url, "alice")
    assert all(p.run == run and not p.is_open for p in pieces)
    # Depending on whether the restarted service's stale check or the hub's first heartbeat comes first, the
    # outage is one piece closed while unseen and continued, or no piece at all.
    assert {p.how for p in pieces[:-1]} <= {"reconciled"} and pieces[-1].how == "stopped", [p.how for p in pieces]
    counted = assert_contiguous_and_once(pieces)
    # Nothing lost (the outage included) and nothing twice: at least from ready to the stop, at most the
    # process's life; bounds that hold however slow the hub and the ledger's writes are on a loaded machine.
    ran = (ended - began).total_seconds()
    at_least = (asked_to_stop - ready).total_seconds()
    assert at_least - GRANULARITY_S <= counted <= ran + GRANULARITY_S, (
        f"ledger {counted} s; billed for sure {at_least:.1f} s, the server ran {ran:.1f} s")
    bill = Ledger(hub.ledger_url, migrate=False).gpu_hours(pieces[0].start.strftime("%Y-%m"), ("user",))
    assert bill[("alice",)] == Fraction(1, 4) * Fraction(counted, 3600)


#: The spawner's own poll (and with it its heartbeats) effectively off: only the service can repair the ledger.
SERVICE_ONLY = FAST.replace("c.Spawner.poll_interval = 1", "c.Spawner.poll_interval = 3600")


def test_a_server_missing_from_the_ledger_is_opened_by_the_service(tmp_path):
    """A lost write (here: the row deleted) is repaired from the hub's REST API, at the hub's `started` time."""
    hub = Hub(tmp_path, POLICY, SERVICE_ONLY, mlflow=False)
    hub.start()
    try:
        hub.add_user("bob", "vision")
        assert hub.api("POST", "/users/bob/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
        server = hub.wait_ready("bob")
        assert server["user_options"] == {"profile": "h200-quarter", "team": "vision"}, \
            "the checked choice is what the hub shows the service"
        (written,) = wait_for(lambda: runs_of(hub.ledger_url, "bob"), what="the spawner's interval")
        ledger = Ledger(hub.ledger_url, migrate=False)
        with ledger.engine.begin() as connection:
            connection.execute(INTERVALS.delete().where(INTERVALS.c.user == "bob"))
        ledger.dispose()
        (piece,) = wait_for(lambda: runs_of(hub.ledger_url, "bob"), 30, "the service reopening the run")
        started = datetime.fromisoformat(server["started"].removesuffix("Z")).replace(tzinfo=UTC)
        assert piece.run == written.run and piece.start == started.replace(microsecond=0)
        assert (piece.team, piece.profile, piece.share) == ("vision", "h200-quarter", Fraction(1, 4))
        seen = piece.last_seen
        wait_for(lambda: runs_of(hub.ledger_url, "bob")[0].last_seen > seen, 30, "the service's heartbeats")
        hub.stop_server("bob")
        (piece,) = wait_for(lambda: [p for p in runs_of(hub.ledger_url, "bob") if not p.is_open], 30, "closed")
        assert piece.how == "stopped"
    finally:
        hub.stop()
        for process in psutil.process_iter(["cmdline"]):
            if str(hub.state) in " ".join(process.info["cmdline"] or []) or _is_service_of(process, hub):
                process.kill()

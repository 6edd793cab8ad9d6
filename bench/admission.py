"""Benchmark: admission decisions per second through the ledger, against the pure decision in memory.

    .venv/bin/python bench/admission.py                       # SQLite in a temporary folder
    .venv/bin/python bench/admission.py --postgres            # and a throwaway PostgreSQL server (initdb, fsync on)
    .venv/bin/python bench/admission.py --url postgresql+psycopg://postgres@127.0.0.1:5432/bench

In one run per database, over a ledger holding HISTORY finished intervals of this month (so that reading the
period's usage costs what it costs on a platform in use):

- **pure**: `admission.decide()` with the holdings and usage in memory, one thread (the baseline);
- **Ledger.admit**: the one door, the decision and the holding it records (`reserved`) under the team's admission
  lock, from 1, 10 and 50 concurrent requester threads of one team (the lock's worst case: they all queue on it),
  twice: one transaction per decision (`group_commit = False`, the path before group commit) and group commit
  (requests that arrive together decided in one transaction, the default). The timed part is the admissions;
  the holdings are closed afterwards, untimed, in one statement;
- **last shares**: 50 requesters at once for a team with room for 4 quarter cards: how many were admitted
  (over-admissions must be 0);
- **queue pass**: one pass of the embedded queue (`LocalPool.schedule`) over 1, 10 and 50 waiting requests, wired
  as the hub wires it (`spawner.local`: the ledger's holdings, the pure decision with the usage read once per
  pass, placements through the door).

Prints decisions per second, each one's ratio to the pure baseline (how many times slower) and group commit's
speed-up over one transaction per decision. Timings vary with the machine; the ratios are the figures to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import sqlalchemy as sa

from gpupool.hub.accounting.ledger import INTERVALS, Ledger
from gpupool.policies import periods
from gpupool.policies import defaults
from gpupool.policies.admission import AdmissionRequest, Holdings, decide
from gpupool.policies.model import Policy
from gpupool.spawner.local import admission, door
from gpupool.spawner.pool import AllocationStore, Card, LocalPool, Request

REQUESTERS = (1, 10, 50)
PROFILE = "h200-quarter"


def make_policy() -> Policy:
    return Policy.model_validate({
        "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami"]}},
        "teams": {"vision": {"quota": {"gpus": 100000, "per_user_gpus": 100000}, "budget": {"gpu_hours": 10**9}},
                  "queued": {"quota": {"gpus": 0.25}, "budget": {"gpu_hours": 10**9}},
                  "scarce": {"quota": {"gpus": 1}, "budget": {"gpu_hours": 10**9}}},
        "profiles": {PROFILE: {"display_name": "0.25 × H200", "gpu": {"model": "H200", "share": 0.25},
                               "teams": ["vision", "queued", "scarce"]}},
        "billing": {"prices": {"H200": "3.20"}},
    })


def fill(ledger: Ledger, history: int) -> None:
    """`history` finished quarter-card intervals of this month, a minute each, across 100 users (one transaction:
    the set-up, not what is measured)."""
    now = periods.utcnow()
    start = max(periods.period_bounds(periods.period_of(now))[0], now - timedelta(days=1))
    rows = []
    for n in range(history):
        begun = start + timedelta(seconds=n % 3600)
        values = ledger._interval_values(f"history-{n}", f"user{n % 100}", "vision", PROFILE, "H200",
                                         Fraction(1, 4), begun, timedelta(0))
        values.update(end_at=begun + timedelta(minutes=1), how="stopped", last_seen_at=begun + timedelta(minutes=1))
        rows.append(values)
    with ledger.engine.begin() as connection:
        connection.execute(INTERVALS.insert(), rows)


def close_all(ledger: Ledger, prefix: str) -> None:
    """Close the bench's open holdings whose keys begin with `prefix` (untimed, one statement)."""
    c = INTERVALS.c
    with ledger.engine.begin() as connection:
        connection.execute(INTERVALS.update().where(c.key.startswith(prefix), c.end_at.is_(None))
                           .values(end_at=c.last_seen_at, how="stopped"))


def pure_rate(policy: Policy, ledger: Ledger, seconds: float) -> float:
    at = periods.utcnow()
    holdings = Holdings.of(ledger.open_intervals())
    usage = ledger.usage(periods.period_of(at), at)
    request = AdmissionRequest(user="alice", team="vision", at=at, profile=PROFILE)
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(100):
            decide(policy, request, holdings, usage)
        count += 100
    return count / (time.perf_counter() - began)


def admit_together(policy: Policy, ledger: Ledger, team: str, requesters: int, per_requester: int,
                   prefix: str) -> tuple[float, int]:
    """`requesters` threads, released at once, each admitting `per_requester` times: decisions/s, how many opened."""
    start_line = threading.Barrier(requesters + 1)
    errors: list[BaseException] = []
    opened = [0] * requesters

    def requester(n: int) -> None:
        try:
            start_line.wait()
            for i in range(per_requester):
                at = periods.utcnow()
                result = ledger.admit(policy, AdmissionRequest(user=f"r{n}", team=team, at=at, profile=PROFILE),
                                      f"{prefix}-{n}-{i}")
                opened[n] += result.opened
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=requester, args=(n,)) for n in range(requesters)]
    for thread in threads:
        thread.start()
    start_line.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return requesters * per_requester / elapsed, sum(opened)


def admit_rate(policy: Policy, ledger: Ledger, requesters: int, per_requester: int, group_commit: bool) -> float:
    ledger.group_commit = group_commit
    prefix = f"bench-{'group' if group_commit else 'single'}-{requesters}"
    try:
        rate, opened = admit_together(policy, ledger, "vision", requesters, per_requester, prefix)
    finally:
        ledger.group_commit = True
    assert opened == requesters * per_requester, f"only {opened} of {requesters * per_requester} admitted"
    close_all(ledger, prefix)
    return rate


def last_shares(policy: Policy, ledger: Ledger, group_commit: bool) -> int:
    """50 requesters at once for team "scarce" (room for 4 quarters): how many were admitted beyond its quota."""
    ledger.group_commit = group_commit
    prefix = f"scarce-{'group' if group_commit else 'single'}"
    try:
        _rate, opened = admit_together(policy, ledger, "scarce", 50, 1, prefix)
    finally:
        ledger.group_commit = True
    held = sum((i.share for i in ledger.open_intervals("scarce")), Fraction(0))
    assert opened == 4 and held == 1, (opened, held)
    close_all(ledger, prefix)
    return opened - 4


def pass_rate(policy: Policy, ledger: Ledger, waiting: int, passes: int, folder: str) -> float:
    """Decisions per second of queue passes over `waiting` requests (team "queued" is full: all wait)."""
    store = AllocationStore(f"{folder}/allocations-{waiting}.sqlite")
    pool = LocalPool([Card("GPU-0", "H200", 0, 141)], store, admission(lambda: policy, ledger),
                     holdings=ledger.holdings, hold=door(lambda: policy, ledger, logging.getLogger()))

    def request(n: int) -> Request:
        # holding: the ledger key, one per start (the spawner's run key), so each run of this bench its own
        return Request(f"q{n}/", f"q{n}", "queued", PROFILE, "0.25 × H200", "H200", Fraction(1, 4),
                       holding=f"q{n}/@bench-{waiting}")

    async def run() -> float:
        await pool.acquire(request(0))  # holds the team's whole quota
        tasks = [asyncio.create_task(pool.acquire(request(n))) for n in range(1, waiting + 1)]
        while len(pool.waiting) < waiting:
            await asyncio.sleep(0.01)
        began = time.perf_counter()
        for _ in range(passes):
            pool.schedule()
            await pool.settled()  # the pass runs in a worker thread; its outcomes applied on the loop
        elapsed = time.perf_counter() - began
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pool.release("q0/")
        ledger.close_run(f"q0/@bench-{waiting}", periods.utcnow(), "stopped")
        return waiting * passes / elapsed

    return asyncio.run(run())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL server (initdb in a temporary folder, durable settings: fsync on); its URL.

    As in tests/conftest.py: initdb and pg_ctl from PATH or /usr/lib/postgresql/*/bin, run as the `postgres` user
    when this runs as root.
    """
    tools = ("initdb", "pg_ctl")
    found = [shutil.which(tool) for tool in tools]
    if all(found):
        bin_dir = Path(found[0]).resolve().parent  # type: ignore[arg-type]
    else:
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True)
        bin_dir = next((c for c in candidates if all((c / tool).exists() for tool in tools)), None)
        if bin_dir is None:
            raise SystemExit("no PostgreSQL here (initdb and pg_ctl); install it (apt-get install postgresql) "
                             "or give --url")
    as_postgres = os.geteuid() == 0

    def run(*command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if as_postgres else []
        done = subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise SystemExit(f"{command[0]} failed:\n{done.stdout}\n{done.stderr}")

    root = Path(tempfile.mkdtemp(prefix="gpupool-bench-pg-"))
    if as_postgres:
        account = pwd.getpwnam("postgres")
        os.chown(root, account.pw_uid, account.pw_gid)
    port = free_port()
    try:
        run(str(bin_dir / "initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        run(str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-w", "-t", "120",
            "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200", "start")
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        try:
            yield url
        finally:
            run(str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(url: str, history: int, admits: int, folder: str) -> None:
    ledger = Ledger(url)
    policy = make_policy()
    print(f"filling the ledger ({ledger.dialect}) with {history:,} intervals …", flush=True)
    fill(ledger, history)
    pure = pure_rate(policy, ledger, 2.0)
    rows: list[tuple[str, int, float, float | None]] = [("pure decide(), in memory (baseline)", 1, pure, None)]
    for requesters in REQUESTERS:
        per = max(1, admits // requesters)
        print(f"Ledger.admit, {requesters} concurrent …", flush=True)
        single = admit_rate(policy, ledger, requesters, per, group_commit=False)
        group = admit_rate(policy, ledger, requesters, per, group_commit=True)
        rows.append(("Ledger.admit, a transaction each (before)", requesters, single, None))
        rows.append(("Ledger.admit, group commit", requesters, group, group / single))
    over = {mode: last_shares(policy, ledger, mode) for mode in (False, True)}
    for waiting in REQUESTERS:
        passes = max(3, 600 // waiting)
        print(f"queue pass, {waiting} waiting …", flush=True)
        rows.append(("queue pass (ledger holdings, door)", waiting,
                     pass_rate(policy, ledger, waiting, passes, folder), None))
    print(f"ledger: {ledger.dialect}, {history:,} finished intervals this month")
    print(f"{'path':<42} {'concurrent':>10} {'decisions/s':>12} {'x slower':>9} {'speed-up':>9}")
    for name, concurrent, rate, speedup in rows:
        print(f"{name:<42} {concurrent:>10} {rate:>12,.0f} {pure / rate:>9.1f} "
              f"{'' if speedup is None else f'{speedup:.1f} x':>9}")
    print(f"last shares: 50 requesters for 4 quarters: over-admissions {over[False]} (a transaction each), "
          f"{over[True]} (group commit)")
    ledger.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="ledger database (default: SQLite in a temporary folder); it must be empty")
    parser.add_argument("--postgres", action="store_true",
                        help="also run on a throwaway PostgreSQL server started here (needs initdb and pg_ctl)")
    parser.add_argument("--history", type=int, default=5000, help="finished intervals in the ledger (default 5000)")
    parser.add_argument("--admits", type=int, default=400, help="Ledger.admit calls per requester count (default 400)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-admission-") as folder:
        measure(args.url or defaults.ledger_url(folder), args.history, args.admits, folder)
        if args.postgres:
            with postgres_server() as url:
                measure(url, args.history, args.admits, folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

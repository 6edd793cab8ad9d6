"""Benchmark: admission decisions per second through the ledger, against the pure decision in memory.

    .venv/bin/python bench/admission.py                       # SQLite in a temporary folder
    .venv/bin/python bench/admission.py --url postgresql+psycopg://postgres@127.0.0.1:5432/bench

In one run, over a ledger holding HISTORY finished intervals of this month (so that reading the period's usage
costs what it costs on a platform in use):

- **pure**: `admission.decide()` with the holdings and usage in memory, one thread (the baseline);
- **Ledger.admit**: the one door, the decision and the holding it records (`reserved`) in one transaction under
  the team's admission lock, from 1, 10 and 50 concurrent requester threads of one team (the lock's worst case:
  they all queue on it); each admitted holding is closed again by its requester;
- **queue pass**: one pass of the embedded queue (`LocalPool.schedule`) over 1, 10 and 50 waiting requests, wired
  as the hub wires it (`spawner.local`: the ledger's holdings, the pure decision with the usage read once per
  pass, placements through the door).

Prints decisions per second and each one's ratio to the pure baseline (how many times slower). Timings vary
with the machine; the ratios are the figures to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import threading
import time
from datetime import timedelta
from fractions import Fraction

from gpupool.hub.accounting import periods
from gpupool.hub.accounting.admission import AdmissionRequest, Holdings, decide
from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies import defaults
from gpupool.policies.model import Policy
from gpupool.spawner.local import admission, door
from gpupool.spawner.pool import AllocationStore, Card, LocalPool, Request

REQUESTERS = (1, 10, 50)
PROFILE = "h200-quarter"


def make_policy() -> Policy:
    return Policy.model_validate({
        "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami"]}},
        "teams": {"vision": {"quota": {"gpus": 100000, "per_user_gpus": 100000}, "budget": {"gpu_hours": 10**9}},
                  "queued": {"quota": {"gpus": 0.25}, "budget": {"gpu_hours": 10**9}}},
        "profiles": {PROFILE: {"display_name": "0.25 × H200", "gpu": {"model": "H200", "share": 0.25},
                               "teams": ["vision", "queued"]}},
        "billing": {"prices": {"H200": "3.20"}},
    })


def fill(ledger: Ledger, history: int) -> None:
    """`history` finished quarter-card intervals of this month, a minute each, across 100 users."""
    now = periods.utcnow()
    start = max(periods.period_bounds(periods.period_of(now))[0], now - timedelta(days=1))
    for n in range(history):
        key = f"history-{n}"
        begun = start + timedelta(seconds=n % 3600)
        ledger.open_interval(key, f"user{n % 100}", "vision", PROFILE, "H200", Fraction(1, 4), begun)
        ledger.close_interval(key, begun + timedelta(minutes=1), "stopped")


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


def admit_rate(policy: Policy, ledger: Ledger, requesters: int, per_requester: int) -> float:
    start_line = threading.Barrier(requesters + 1)
    errors: list[BaseException] = []

    def requester(n: int) -> None:
        try:
            start_line.wait()
            for i in range(per_requester):
                key = f"bench-{requesters}-{n}-{i}"
                at = periods.utcnow()
                result = ledger.admit(policy, AdmissionRequest(user=f"r{n}", team="vision", at=at, profile=PROFILE),
                                      key)
                assert result.opened, result.decision.reason
                ledger.close_interval(key, periods.utcnow(), "stopped")
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
    return requesters * per_requester / elapsed


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="ledger database (default: SQLite in a temporary folder); it must be empty")
    parser.add_argument("--history", type=int, default=5000, help="finished intervals in the ledger (default 5000)")
    parser.add_argument("--admits", type=int, default=400, help="Ledger.admit calls per requester count (default 400)")
    args = parser.parse_args(argv)
    folder = tempfile.TemporaryDirectory(prefix="gpupool-bench-admission-")
    ledger = Ledger(args.url or defaults.ledger_url(folder.name))
    policy = make_policy()
    print(f"filling the ledger ({ledger.dialect}) with {args.history:,} intervals …", flush=True)
    fill(ledger, args.history)
    pure = pure_rate(policy, ledger, 2.0)
    rows = [("pure decide(), in memory (baseline)", 1, pure)]
    for requesters in REQUESTERS:
        per = max(1, args.admits // requesters)
        rows.append(("Ledger.admit (decide + hold, locked)", requesters, admit_rate(policy, ledger, requesters, per)))
    for waiting in REQUESTERS:
        passes = max(3, 600 // waiting)
        rows.append(("queue pass (ledger holdings, door)", waiting, pass_rate(policy, ledger, waiting, passes,
                                                                             folder.name)))
    print(f"ledger: {ledger.dialect}, {args.history:,} finished intervals this month")
    print(f"{'path':<40} {'concurrent':>10} {'decisions/s':>12} {'x slower':>9}")
    for name, concurrent, rate in rows:
        print(f"{name:<40} {concurrent:>10} {rate:>12,.0f} {pure / rate:>9.1f}")
    ledger.dispose()
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

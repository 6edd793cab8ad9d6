"""The accounting service's tests' policy and seeded ledger, shared by the in-process routing tests
(`tests/unit/hub/test_accounting_routes.py`) and the person's path through a real hub
(`tests/e2e/test_accounting_service.py`). A support module, imported by name (`pythonpath = tests`)."""

from __future__ import annotations

from datetime import datetime, timedelta
from fractions import Fraction

from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.periods import utcnow

#: Two teams on two H200: vision (alice, and lena its lead) with a budget of 100 GPU-hours, nlp (nadia) with 1,
#: denied when spent.
POLICY = """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [alice, lena], leads: [lena], budget: {gpu_hours: 100}}
  nlp: {members: [nadia], budget: {gpu_hours: 1, on_exhausted: deny}}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp]}
billing: {prices: {H200: '3.20'}}
"""


def seed(ledger: Ledger) -> datetime:
    """Two finished intervals of vision's and nadia's running one, all this month; the runs' queue waits. Returns
    when they began (the first hours of a month are enough)."""
    now = utcnow().replace(microsecond=0)
    start = max(now - timedelta(hours=10), now.replace(day=1, hour=0, minute=0, second=0))
    ledger.open_interval("alice-1", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("alice-1", start + timedelta(seconds=7200), "stopped")  # 0.5 GPU-h
    ledger.open_interval("lena-1", "lena", "vision", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("lena-1", start + timedelta(seconds=3600), "stopped")  # 0.25 GPU-h
    # Reserving 4 hours: nlp's 1 GPU-hour budget counts as used from the start, however early in the month this runs.
    ledger.open_interval("nadia-1", "nadia", "nlp", "h200-quarter", "H200", Fraction(1, 4), start,
                         reserve=timedelta(hours=4))
    # A run of lena's that queued 30 s and ended at once: a queue wait on record, no GPU-hours.
    ledger.keep_run("lena/@seeded", "lena", "vision", "h200-quarter", "H200", Fraction(1, 4), start, start,
                    queue_wait=timedelta(seconds=30))
    ledger.close_run("lena/@seeded", start, "stopped")
    # Three of alice's runs placed at once (a wait of 0 s on record): they did not wait, and must not count.
    for n in range(3):
        ledger.keep_run(f"alice/@at-once-{n}", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), start,
                        start, queue_wait=timedelta(0))
        ledger.close_run(f"alice/@at-once-{n}", start, "stopped")
    return start

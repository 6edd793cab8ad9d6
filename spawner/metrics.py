"""The hub process's own metrics, beside JupyterHub's at /hub/metrics (prometheus_client's default registry).

The accounting service exports the ledger's figures (usage, budgets, queue waits of the period) itself; these
are what only the hub sees: its queue as it is now, and each admission outcome as it happens.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_LENGTH = Gauge("gpupool_queue_length", "Requests waiting in the embedded pool's queue", ["team"])
QUEUE_WAIT = Histogram("gpupool_queue_wait_seconds", "Time requests waited in the queue before they were placed",
                       ["team"], buckets=(1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600))
ADMISSION_DECISIONS = Counter(
    "gpupool_admission_decisions",
    "Admission outcomes by action (admit, wait, deny, end) and reason code, each counted once per request: a "
    "request that goes on waiting for the same reason is one",
    ["action", "reason"],
)
LEDGER_WRITE_ERRORS = Counter("gpupool_ledger_write_errors", "Usage ledger writes that failed", ["operation"])


def count_decision(code) -> None:
    """One more admission outcome with reason `code` (a `Reason`; its action is implied by it)."""
    ADMISSION_DECISIONS.labels(code.action, str(code)).inc()

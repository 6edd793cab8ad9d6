"""Accounting: the usage ledger, admission against quotas and budgets, and bills, independent of JupyterHub.

- `periods`: the one `utcnow()`, billing periods (UTC months) and `split_by_month`;
- `admission`: `decide()`, the pure admission decision both spawners use (through `notify.admit_now`);
- `ledger`: `Ledger`, idempotent usage intervals, exact GPU-hour sums, and `Ledger.admit`, which decides
  and opens the interval under a lock (not yet called by the spawners);
- `notify`: `admit_now`, the decision against the ledger's usage with its budget alerts sent;
- `bills`: `bill_for`, `render_bill` (CSV, JSON, HTML) and `bill_command` for `gpupool bill`;
- `db`: the tables, engines (SQLite WAL, PostgreSQL with psycopg 3) and the Alembic migrations.
"""

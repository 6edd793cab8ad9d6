"""Accounting: the usage ledger, admission against quotas and budgets, and bills, independent of JupyterHub.

- `periods`: the one `utcnow()`, billing periods (UTC months) and `split_by_month`;
- `admission`: `decide()`, the pure admission decision, and the reason codes;
- `ledger`: `Ledger`, idempotent usage intervals, exact GPU-hour sums, and `Ledger.admit`, the one door every
  workload is admitted through: it decides and holds the share (`reserved`, not billed until it runs) under a
  per-team lock, in one transaction;
- `notify`: `admit`, the door with its budget alerts delivered (logged, posted to the webhook);
- `bills`: `bill_for`, `render_bill` (CSV, JSON, HTML) and `bill_command` for `gpupool bill`;
- `db`: the tables, engines (SQLite WAL, PostgreSQL with psycopg 3) and the Alembic migrations.
"""

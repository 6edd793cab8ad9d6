"""Accounting: the usage ledger, admission against quotas and budgets, and bills, independent of JupyterHub.

- `periods`: the one `utcnow()`, billing periods (UTC months) and `split_by_month`;
- `admission`: `decide()`, the pure admission decision both spawners use;
- `ledger`: `Ledger`, idempotent usage intervals, exact GPU-hour sums, `Ledger.admit` under a lock;
- `bills`: `bill_for`, `render_bill` (CSV, JSON, HTML) and `bill_command` for `gpupool bill`;
- `db`: the tables, engines (SQLite WAL, PostgreSQL with psycopg 3) and the Alembic migrations.
"""

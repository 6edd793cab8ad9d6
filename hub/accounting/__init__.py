"""The records: the usage ledger and its one door, job and cull stores, bills and reports, independent of JupyterHub.

The pure decisions they record (`admission`, `preemption`, `restarts`, `idleness`, `periods`, `placement`) are one
floor below, in `gpupool.policies`.

- `ledger`: `Ledger`, idempotent usage intervals, exact GPU-hour sums, and `Ledger.admit`, the one door every
  workload is admitted through: it decides and holds the share (`reserved`, not billed until it runs) under a
  per-team lock, in one transaction;
- `notify`: `admit`, the door with its budget alerts delivered (logged, posted to the webhook);
- `bills`: `bill_for`, `render_bill` (CSV, JSON, HTML) and `bill_command` for `gpupool bill`;
- `db`: the tables, engines (SQLite WAL, PostgreSQL with psycopg 3) and the Alembic migrations;
- `jobs`, `culls`, `servers`: the jobs table, the idle culler's records, server runs and their reconciliation;
- `reports`, `charts`, `export`: usage reports, their charts, and exports.
"""

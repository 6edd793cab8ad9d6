"""Alembic's environment for the ledger: runs on the connection `gpupool.hub.accounting.db.migrate()` passes."""

from __future__ import annotations

from alembic import context

from gpupool.hub.accounting.db import VERSION_TABLE, Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "the ledger's migrations run through gpupool.hub.accounting.db.migrate(engine), "
        "which passes the connection; there is no alembic.ini"
    )

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    # SQLite can only change most column definitions by copying the table; batch mode does that.
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()

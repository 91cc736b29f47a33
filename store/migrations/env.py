"""Alembic environment. Migrations run on a connection handed in by store.migrate (see there)."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `exports migrate` (store.migrate), which supplies the connection")

context.configure(connection=connection, transactional_ddl=True)
with context.begin_transaction():
    context.run_migrations()

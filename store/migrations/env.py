"""Alembic environment. Online, migrations run on a connection handed in by store.migrate (see there); offline
(`exports migrate --sql`, store.db.migration_sql), they are written out as SQL for psql, connecting to nothing."""

from __future__ import annotations

from alembic import context

if context.is_offline_mode():
    context.configure(
        dialect_name="postgresql",
        dialect_opts={"paramstyle": "named"},  # the default (pyformat) would write every % of a script as %%
        literal_binds=True,
        transactional_ddl=True,
        # As the online run does it (store.db.migrate): an upgrade commits each migration, a downgrade is one
        transaction_per_migration=context.config.attributes.get("transaction_per_migration", False),
        output_buffer=context.config.attributes.get("output_buffer"),
    )
else:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `exports migrate` (store.migrate), which supplies the connection")
    context.configure(connection=connection, transactional_ddl=True,
                      transaction_per_migration=context.config.attributes.get("transaction_per_migration", False))

with context.begin_transaction():
    context.run_migrations()

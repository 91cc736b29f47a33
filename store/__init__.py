"""PostgreSQL: table metadata, migrations, the documented statements, roles and grants."""

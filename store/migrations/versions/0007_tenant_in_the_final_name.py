"""The final name at the partner carries the tenant: `contacts-<tenant id>-<delivery key>.csv`.

Delivery keys are chosen by platform teams, so two tenants whose destinations share a partner directory could
choose the same key and share a final name: one tenant's export then failed on the other's file, a replacement
with an overwrite agreement replaced it, and name-and-size evidence identified it. Refusing destinations that
share a directory cannot work (two host names may reach one server); minting keys would take from platform
teams the names their partners expect. A tenant component makes the names of two tenants disjoint whatever keys
they choose, and the temporary names, acknowledgments and the partner sweep all derive from the final name.

The name is a column, written once at creation and copied by a replacement from its original, so that every
attempt, replacement, recovery look and sweep reads the same name from the row, and no role may change it (no
column grant). Rows from before this migration: a delivery that was ever claimed keeps the name its file may
already have at the partner (`contacts-<delivery key>.csv`), since its replacements and reconciliations must find
that file; a delivery never claimed has nothing at the partner and moves to the name with the tenant in it. The
check admits the old name only on such rows (claimed, or a replacement of one), so no new export can take it.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE export_jobs ADD COLUMN final_name text")
    # The backfill queues the deferred event checks of 0005 (which pass for the owner); run them now, since
    # ALTER TABLE refuses a table with pending trigger events.
    op.execute("SET CONSTRAINTS ALL IMMEDIATE")
    op.execute("""
        UPDATE export_jobs j SET final_name = CASE
            WHEN EXISTS (SELECT 1 FROM export_jobs d
                         WHERE d.tenant_id = j.tenant_id AND d.delivery_key = j.delivery_key
                           AND d.attempt_count > 0)
            THEN 'contacts-' || j.delivery_key || '.csv'
            ELSE 'contacts-' || j.tenant_id || '-' || j.delivery_key || '.csv'
        END
    """)
    op.execute("""
        ALTER TABLE export_jobs
            ALTER COLUMN final_name SET NOT NULL,
            ADD CONSTRAINT ck_export_jobs_final_name CHECK (
                final_name = 'contacts-' || tenant_id || '-' || delivery_key || '.csv'
                OR (final_name = 'contacts-' || delivery_key || '.csv'
                    AND (attempt_count > 0 OR replaces_job_id IS NOT NULL)))
    """)
    # The partner sweep asks, per temporary file, whether its final name is one of the destination's.
    op.execute("CREATE INDEX ix_export_jobs_destination_final_name ON export_jobs (destination_id, final_name)")


def downgrade() -> None:
    op.execute("ALTER TABLE export_jobs DROP COLUMN final_name")

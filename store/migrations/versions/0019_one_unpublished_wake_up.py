"""The sweeper adds no wake-up while an earlier one waits unpublished.

While no dispatcher could publish (Temporal away, every dispatcher down), each sweep past the threshold found a
Queued export stranded again and added a wake-up: 48 a day for one export at the 30-minute default, each sent as a
signal once Temporal came back. One unpublished wake-up wakes the run as well as any number, so the sweep now
writes one only where none of the export's wake-ups waits unpublished (sweep.sql).

- `ix_outbox_unpublished_job`: the unpublished wake-ups by export, so that the sweep asks for an export's by an
  index probe; the outbox keeps its published rows, and the only other index on unpublished rows is by age.

Building it takes a SHARE lock on `outbox` (writes wait) while it reads the table once: run it with the workers
stopped, as the upgrade notes say. Rolling back drops the index; the earlier sweep never uses it.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UPGRADE = (
    "CREATE INDEX ix_outbox_unpublished_job ON outbox (job_id) WHERE published_at IS NULL",
)

DOWNGRADE = (
    "DROP INDEX ix_outbox_unpublished_job",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

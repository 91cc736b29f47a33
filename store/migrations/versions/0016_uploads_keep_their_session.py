"""An upload keeps its partner session while it runs (LD3), whatever its export's row says meanwhile.

A session slot (0011) was free as soon as its export's row no longer named the attempt Running or Delivering. An
upload goes on to its end past a lost lease, though: when recovery took back an attempt whose worker could not
renew (cut off from the database, or paused) while its upload still ran, the slot counted free, and another
export opened a second session at a partner whose contract allows one.

- `partner_sessions.uploading_until`: NULL, or until when the attempt's upload keeps its slot. The upload sets it
  a lease ahead as it starts and renews it while it runs (keep_partner_session.sql); the slot is live while the
  row names the attempt or this time has not passed, so an upload whose worker dies or is cut off gives it up a
  lease after its last renewal.

Nullable, no default: no table rewrite. The application's UPDATE on the table (0011) covers the column. Rolling
back drops it; earlier releases count a slot free once the row moves on, as before.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UPGRADE = (
    "ALTER TABLE partner_sessions ADD COLUMN uploading_until timestamptz",
)

DOWNGRADE = (
    "ALTER TABLE partner_sessions DROP COLUMN uploading_until",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

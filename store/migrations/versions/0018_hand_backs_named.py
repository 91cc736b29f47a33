"""A hand-back names its attempt, so recovery counts it against one cap only.

An attempt handed back by its own worker (release_lease.sql) was counted in `handed_back_count`; recovery's
take-back then also judged how it was lost (recovery_loss.sql). When two uploads of one worker were handed back at
once, each was judged `lost with its worker` as well, and the count of attempts lost alone subtracted it twice:
the export was allowed one attempt lost alone more than `EXPORTS_MAX_ATTEMPTS`.

- `export_jobs.handed_back_attempt`: NULL, or the last attempt whose hand-back was counted. release_lease.sql
  writes it with the count; the take-back records such an attempt `handed back by its worker`, a detail that none
  of the other caps counts.
- The application may update it: like the count, in a renewal-shaped write, which the change check (0005) leaves
  alone; a transition must leave it as it was, and does (it names an attempt, so it never needs clearing).

Nullable, no default: no table rewrite. Rolling back drops it; earlier releases judge a handed-back attempt as
any lost one, as before.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# The column the application may now update, besides the earlier migrations' APP_COLUMNS (starter/preflight.py).
APP_COLUMNS = "handed_back_attempt"

UPGRADE = (
    "ALTER TABLE export_jobs ADD COLUMN handed_back_attempt uuid",
    f"GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app",
)

DOWNGRADE = (
    "ALTER TABLE export_jobs DROP COLUMN handed_back_attempt",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

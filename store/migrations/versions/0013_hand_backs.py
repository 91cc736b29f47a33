"""Hand-backs counted apart from lost attempts (issue 23's goal, matrix LV8 and RI9).

- `export_jobs.handed_back_count`: how many of the export's attempts were handed back by their own worker before
  their rename (release_lease.sql, a Delivering attempt whose rename fence is open: the upload failed and the
  final name could not be looked at). Recovery then sends the export round again, as after a lost worker, but
  the attempt cap (EXPORTS_MAX_ATTEMPTS) counts only the attempts that were not handed back, and the hand-backs
  have a cap of their own (EXPORTS_MAX_HAND_BACKS): a partner that drops every upload still ends the export.
  NOT NULL DEFAULT 0, a constant: no table rewrite.
- The application may update it. Like the lease, it changes in a renewal-shaped write (the lease ends in the same
  statement), which the change check (0005) leaves alone; no transition changes it, and a transition that did
  would be refused (a column added later is frozen in every transition).

Rolling back drops it; earlier releases count every attempt toward the cap.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# The column the application may now update, besides 0005's and 0010's APP_COLUMNS (starter/preflight.py checks).
APP_COLUMNS = "handed_back_count"

UPGRADE = (
    "ALTER TABLE export_jobs ADD COLUMN handed_back_count integer NOT NULL DEFAULT 0"
    " CHECK (handed_back_count >= 0)",
    f"GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app",
)

DOWNGRADE = (
    "ALTER TABLE export_jobs DROP COLUMN handed_back_count",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

"""Attempts lost together with their worker are capped apart (issue 23's full-profile goal, matrix LV8 and RI9).

When a worker is killed, paused past its lease or cut off, every attempt it holds lapses together, and until now
each counted against that export's attempt cap (EXPORTS_MAX_ATTEMPTS, 3), as if the export had killed its worker.
Recovery now tells the two apart (store/sql/recovery_loss.sql): an attempt is lost *with its worker* when another
attempt of the same worker lapsed with it (its lease ran out, or runs out within one renewal interval, unrenewed)
or was taken over by recovery shortly before. Such a loss counts against EXPORTS_MAX_SHARED_LOSSES instead (10), a
looser cap that still ends a job which kills a busy worker every time; a loss with nothing else of the worker lost
still counts against EXPORTS_MAX_ATTEMPTS.

The kind of loss is recorded on recovery's event (RequeuedByRecovery, AttemptsExhausted): `worker_id` names the
worker that lost the attempt, `detail` says `lost with its worker` or `lost alone`. No new column: the count of an
export's losses with their worker is read from its events, which no role may change. This migration only adds
the index by which recovery finds a worker's recent losses; events written before it name no worker and are not
in it (a loss before the upgrade counts as lost alone, as it did).

Building the index reads the events table once and holds back its inserts meanwhile (seconds for millions of
rows). Rolling back drops it; earlier releases record no worker on these events and count every loss alike.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = (
    "CREATE INDEX ix_attempt_events_worker_losses ON export_attempt_events (worker_id, recorded_at)"
    " WHERE kind IN ('RequeuedByRecovery', 'AttemptsExhausted') AND worker_id IS NOT NULL",
)

DOWNGRADE = (
    "DROP INDEX ix_attempt_events_worker_losses",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

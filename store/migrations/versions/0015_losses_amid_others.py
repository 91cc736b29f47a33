"""Losses amid other workers' losses are capped apart (issue 23's full-profile goal, matrix LV8, RI8 and RI9).

Where workers are lost whatever they hold (a failing host pool, the full chaos profile's kill every 1.6 s), an
export can be lost with its worker ten times in a row by chance, and ended AttemptsExhausted at
EXPORTS_MAX_SHARED_LOSSES though nothing in it was at fault. Recovery now also asks whether, in the same window (a
lease and a recovery interval), a worker that never held the export was lost too (store/sql/recovery_loss.sql). If
one was, the loss says nothing about the export and counts against EXPORTS_MAX_LOSSES_AMID_OTHERS (30), the
ceiling; a job that kills every worker it meets, on a fleet lost only through it, still meets the caps it met.
Recovery's event says `lost amid other workers' losses`.

No new column or grant: this migration only adds the index by which recovery finds the workers lost recently,
whatever they held (0014's is keyed by the worker). It covers recovery's events that name the worker that lost the
attempt, as 0014's does.

Building the index reads the events table once and holds back its inserts meanwhile (seconds for millions of
rows). Rolling back drops only the index: the events keep saying how each attempt was lost; 0.2.0 counts every
loss alike, toward its attempt cap.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

UPGRADE = (
    "CREATE INDEX ix_attempt_events_recent_losses ON export_attempt_events (recorded_at)"
    " WHERE kind IN ('RequeuedByRecovery', 'AttemptsExhausted') AND worker_id IS NOT NULL",
)

DOWNGRADE = (
    "DROP INDEX ix_attempt_events_recent_losses",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

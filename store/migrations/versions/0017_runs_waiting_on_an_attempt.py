"""A run that waits on an attempt is woken by that attempt's terminal write.

When Temporal gives a step up (its heartbeats stopped reaching the server: the worker paused, or the server or the
way to it down), the run reads the row, finds it still `Running` or `Delivering`, and waits for a wake-up. The
step, still running, then wrote its outcome (an upload's terminal write; a late cutoff 2's `Stopped` or `Failed`)
with a wake-up only if it could tell, from its own heartbeats, that the step had been given up, and heartbeats sent
that never reached the server look fresh to it; cutoff 2's own writes asked for none at all. The run then learnt of
its export's end only at its idle recheck (5 minutes).

- `export_jobs.run_waits_for`: NULL, or the attempt a run found under way and waits on. The run's read of a
  `Running` or `Delivering` row writes it (run_waits_on_attempt.sql), and the attempt's terminal writes
  (finish_delivery.sql, finish_stopped.sql, finish_failed.sql) write a wake-up when it names the attempt. Both take
  the row lock, so either the run reads the settled row or the write sees the mark.
- The application may update it. Like a renewal it changes no state and is made only while the row holds a lease,
  so the change check (0005) leaves it alone; a transition must leave it as it was, and does (it names an
  attempt, so it never needs clearing). A forged mark can only cause a wake-up, which makes a run read its row.

Nullable, no default: no table rewrite. Rolling back drops it; earlier releases wake a waiting run only when the
upload knows its step was given up, and the idle recheck settles the rest.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# The column the application may now update, besides the APP_COLUMNS of 0005, 0010 and 0013 (starter/preflight.py).
APP_COLUMNS = "run_waits_for"

UPGRADE = (
    "ALTER TABLE export_jobs ADD COLUMN run_waits_for uuid",
    f"GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app",
)

DOWNGRADE = (
    "ALTER TABLE export_jobs DROP COLUMN run_waits_for",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

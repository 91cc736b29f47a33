"""A cutoff 2 that its run gave up authorizes nothing, even where the step cannot tell it was given up.

A step's own bound counts the heartbeats it sent. A worker cut off from Temporal (not from PostgreSQL) sends them
on time to no one: Temporal gives the step up, the run reads the row again and waits, and the step then committed
`Delivering` for an attempt that nobody would deliver, holding its lease, its upload slot and its partner session
for a hand-over window (found by review). Only the run knows it gave the step up, so it says so: its next read
names that attempt (`AdmitInput.given_up`) and marks it, and cutoff 2 refuses a marked attempt.

- `export_jobs.cutoff_2_given_up`: NULL, or the attempt whose cutoff 2 its run gave up. The run's read of a
  `Running` row of that attempt writes it (run_waits_on_attempt.sql); authorize_delivery.sql refuses an attempt it
  names. A claim step of another run, or one the run scheduled before it gave anything up, names no such attempt,
  so it can never mark the attempt that a live run drives (a mark written by any read did: review J).
- The application may update it, in a renewal-shaped write, which the change check (0005) leaves alone only
  where it names the row's own attempt: cleared, or pointed at another attempt, the change is checked, and no
  documented transition makes it, so it is refused (found by review: a cleared mark let the given-up step
  authorize). A new export has none, and a queued row's own edits leave it alone (0021's lists, extended). It
  names an attempt, so it never needs clearing. A forged mark costs that attempt (it is handed back), never a
  second delivery.

Nullable, no default: no table rewrite. Rolling back restores the two rule functions and drops the column; earlier
releases let such a late cutoff 2 commit, and recovery takes the attempt back a hand-over window later.

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

from store.migrations.steps import edit_function, execute_each

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# The column the application may now update, besides the earlier migrations' APP_COLUMNS (starter/preflight.py).
APP_COLUMNS = "cutoff_2_given_up"

CREATION = (
    ("        AND NEW.run_waits_for IS NULL\n",
     "        AND NEW.run_waits_for IS NULL AND NEW.cutoff_2_given_up IS NULL\n"),
)

QUEUED = tuple((f"{x}.run_waits_for)", f"{x}.run_waits_for, {x}.cutoff_2_given_up)") for x in ("n", "o"))

# The renewal's list ends so (0010 added the fence); NULL-safe, as every condition of the rules.
RENEWAL = (
    ("o.rename_fence);\n",
     "o.rename_fence)\n"
     "               -- 0022: a renewal-shaped write may only mark the row's own attempt as given up\n"
     "               OR (n.cutoff_2_given_up IS DISTINCT FROM o.cutoff_2_given_up\n"
     "                   AND n.cutoff_2_given_up IS DISTINCT FROM n.attempt_id);\n"),
)

UPGRADE = (
    "ALTER TABLE export_jobs ADD COLUMN cutoff_2_given_up uuid",
    f"GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app",
    edit_function("0022", "exports_new_job_is_queued_with_its_wakeup", CREATION),
    edit_function("0022", "exports_job_change_is_checked", QUEUED + RENEWAL),
)

DOWNGRADE = (
    edit_function("0022", "exports_job_change_is_checked", QUEUED + RENEWAL, undo=True),
    edit_function("0022", "exports_new_job_is_queued_with_its_wakeup", CREATION, undo=True),
    "ALTER TABLE export_jobs DROP COLUMN cutoff_2_given_up",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

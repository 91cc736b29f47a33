"""The columns of an attempt that 0010 to 0018 added are checked by the rules like the older ones (found by review).

The rules of 0005 (GR1) say that a new export is Queued with nothing of an attempt, and that a queued row's own
edits (terms, sweep) change only `destination_id`, `version`, `woken_at` and `sweep_count`. They listed the
columns of 0001, and 0010 added its rename fence to the second list only. So the application could insert a job
whose `handed_back_count` already stood at the hand-back cap (recovery would then end it `AttemptsExhausted` at its
first hand-back), with a `rename_fence`, a `handed_back_attempt` or a `run_waits_for`; and on a Queued row it
could reset `handed_back_count` (undoing the cap that 0013 promises: a partner that drops every upload still ends
the export), clear `handed_back_attempt` or write `run_waits_for`, with no event. No statement does either.

- `exports_new_job_is_queued_with_its_wakeup`: a new export also has no rename fence, no hand-back (count 0, no
  attempt) and no run waiting on an attempt.
- `exports_job_change_is_checked`: a queued row's own edits also leave `handed_back_count`, `handed_back_attempt`
  and `run_waits_for` alone. (A renewal may still change them: `release_lease.sql` counts a hand-back and
  `run_waits_on_attempt.sql` marks the row, both as renewals, on Running or Delivering rows.)

Rolling back restores the two functions as 0020 left them.

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

from store.migrations.steps import edit_function, execute_each

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

CREATION = (
    ("        AND NEW.rejection_reason IS NULL AND NEW.sweep_count = 0\n",
     "        AND NEW.rejection_reason IS NULL AND NEW.sweep_count = 0\n"
     "        AND NEW.rename_fence IS NULL AND NEW.handed_back_count = 0 AND NEW.handed_back_attempt IS NULL\n"
     "        AND NEW.run_waits_for IS NULL\n"),
)

# The queued branch's lists end so (0010 added the fence); the renewal's lists end `x.sweep_count,\n ... fence)`.
QUEUED = tuple(
    (f"{x}.failure_reason, {x}.confirmed_by, {x}.rejection_reason, {x}.rename_fence)",
     f"{x}.failure_reason, {x}.confirmed_by, {x}.rejection_reason, {x}.rename_fence,\n"
     f"                {x}.handed_back_count, {x}.handed_back_attempt, {x}.run_waits_for)")
    for x in ("n", "o"))

UPGRADE = (
    edit_function("0021", "exports_new_job_is_queued_with_its_wakeup", CREATION),
    edit_function("0021", "exports_job_change_is_checked", QUEUED),
)

DOWNGRADE = (
    edit_function("0021", "exports_job_change_is_checked", QUEUED, undo=True),
    edit_function("0021", "exports_new_job_is_queued_with_its_wakeup", CREATION, undo=True),
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

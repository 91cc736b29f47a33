"""The rename fence: an upload renames only after a conditional write on its row, so recovery can prove that an
expired attempt never renamed and never will, and send the export round again (issue 23).

Before this migration, an expired Delivering attempt could only be resolved from evidence: its worker might be
paused, not dead, and rename later, so no file at the final name proved nothing, and a crash anywhere in an upload
ended OutcomeUnknown. Now:

- Cutoff 2 opens the fence (`rename_fence = 'open'`). The upload's last step before the rename is
  `pass_rename_fence.sql`, which moves it to `'passed'` only for the attempt and build that hold the Delivering
  row; the worker sends the rename only after that write has committed.
- Recovery requeues (or, at the attempt cap, fails with AttemptsExhausted) an expired Delivering attempt whose fence
  is still open, as it does an expired Running one. The requeue and the fence's write name the same row, so
  PostgreSQL orders them: once the requeue commits, the fence can no longer pass and that attempt can never rename;
  once the fence has passed, the attempt is resolved from evidence as before.
- A replacement's attempt is not requeued: a file at its final name may be the original's, which only evidence
  tells apart (it is resolved as before).
- An attempt authorized by a worker of 0.2.0 leaves the fence NULL (its cutoff 2 does not open it) and its upload
  does not pass it: recovery resolves it from evidence, as 0.2.0 did, so a rolling upgrade never requeues an
  attempt that might still rename unfenced.

The rules (GR1) learn the fence: cutoff 2 may open it, only the Delivering row's own attempt may pass it, a requeue
of a Delivering row needs it open and clears it with the file the attempt was to deliver, and AttemptsExhausted may
end a Delivering row only while it is open. `exports_job_change_is_checked` lists the column, so no renewal or
queued edit changes it unchecked.

Rolling back drops the column; rows requeued from Delivering are ordinary Queued rows to earlier releases.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from store.migrations.steps import edit_function, execute_each

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Every condition below is written NULL-safe: a fits that is NULL would let the move through.

# The two lists of columns a renewal or a queued edit leaves alone (both written `..., x.rejection_reason)`).
CHECKED = (("n.confirmed_by, n.rejection_reason)", "n.confirmed_by, n.rejection_reason, n.rename_fence)"),
           ("o.confirmed_by, o.rejection_reason)", "o.confirmed_by, o.rejection_reason, o.rename_fence)"))

GR1 = (
    ("            kinds := '{DeliveryAuthorized}';",
     "            kinds := '{DeliveryAuthorized}';\n"
     "            frozen.rename_fence := OLD.rename_fence;\n"
     "            fits := NEW.rename_fence IS NULL OR NEW.rename_fence = 'open';\n"
     "            rule := 'cutoff 2 may only open the rename fence';"),
    ("        WHEN OLD.status = 'Running' AND NEW.status = 'Queued' THEN  -- recovery_requeue",
     "        WHEN OLD.status IN ('Running', 'Delivering') AND NEW.status = 'Queued' THEN  -- recovery_requeue\n"
     "            frozen.expected_file_name := OLD.expected_file_name;\n"
     "            frozen.expected_file_bytes := OLD.expected_file_bytes;\n"
     "            frozen.expected_file_sha256 := OLD.expected_file_sha256;\n"
     "            frozen.delivery_authorized_at := OLD.delivery_authorized_at;\n"
     "            frozen.rename_fence := OLD.rename_fence;"),
    ("            rule := 'a requeue clears the attempt, its holder and its lease';",
     "            fits := fits AND (OLD.status = 'Running' OR OLD.rename_fence IS NOT DISTINCT FROM 'open')\n"
     "                AND NEW.expected_file_name IS NULL AND NEW.expected_file_bytes IS NULL\n"
     "                AND NEW.expected_file_sha256 IS NULL AND NEW.delivery_authorized_at IS NULL\n"
     "                AND NEW.rename_fence IS NULL;\n"
     "            rule := 'a requeue clears the attempt, its holder, its lease and its file, and takes back only an'\n"
     "                    ' attempt that has not passed its rename fence';"),
    ("        WHEN OLD.status = 'Delivering' AND NEW.status IN ('Completed', 'Failed', 'OutcomeUnknown') THEN\n"
     "            kinds := '{Finished,ResolvedByRecovery}';  -- finish_delivery, recovery_resolve",
     "        WHEN OLD.status = 'Delivering' AND NEW.status = 'Delivering' THEN  -- pass_rename_fence\n"
     "            frozen.rename_fence := OLD.rename_fence;\n"
     "            fits := NEW.rename_fence IS NOT DISTINCT FROM 'passed';\n"
     "            rule := 'only the rename fence may change, to passed';\n"
     "        WHEN OLD.status = 'Delivering' AND NEW.status IN ('Completed', 'Failed', 'OutcomeUnknown') THEN\n"
     "            -- finish_delivery, recovery_resolve, recovery_exhausted (an attempt that never passed its fence)\n"
     "            kinds := '{Finished,ResolvedByRecovery,AttemptsExhausted}';\n"
     "            fits := NEW.failure_reason IS DISTINCT FROM 'AttemptsExhausted'\n"
     "                OR OLD.rename_fence IS NOT DISTINCT FROM 'open';\n"
     "            rule := 'only an attempt that never passed its rename fence is exhausted';"),
)

# The column the application may now update, besides 0005's APP_COLUMNS (starter/preflight.py checks both).
APP_COLUMNS = "rename_fence"

UPGRADE = (
    "ALTER TABLE export_jobs ADD COLUMN rename_fence text CHECK (rename_fence IN ('open', 'passed'))",
    f"GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app",
    edit_function("0010", "exports_job_change_is_checked", CHECKED),
    edit_function("0010", "exports_job_change_has_its_event", GR1),
)

DOWNGRADE = (
    edit_function("0010", "exports_job_change_has_its_event", GR1, undo=True),
    edit_function("0010", "exports_job_change_is_checked", CHECKED, undo=True),
    "ALTER TABLE export_jobs DROP COLUMN rename_fence",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

"""The rename fence passes only with its holder's evidence in the same transaction (found by review).

0010 says that only the Delivering row's own attempt may pass its rename fence, and `pass_rename_fence.sql` names
the attempt and its holder; but the rule's branch for `Delivering -> Delivering` asked only that the fence move to
`passed`. A bare `UPDATE export_jobs SET rename_fence = 'passed'` by the application, naming neither the attempt
nor its holder and writing no evidence, passed it: recovery then resolved that attempt from evidence
(OutcomeUnknown without a receipt) instead of taking it back and sending the export round again.

- `exports_job_change_has_its_event`: the fence passes only if the same transaction wrote a `DeliveryEvidence`
  record of this attempt whose holder is the row's `claimed_by`. 0008's stamp keeps a record's holder only where
  the writer named the build that holds the Delivering row, so the proof is the writer's naming of the attempt and
  its holder, as `pass_rename_fence.sql` does in one statement (its "step rename" record). Known limit, as 0008's:
  the workers share one role, so a worker may name another's holder; the rule binds the fence to the attempt that
  holds the row, not to a process.

- `ix_attempt_events_evidence`: a partial index of the evidence records by export and attempt, so that the
  check, run at the commit of every fence pass under the row lock, finds the record without scanning every event
  (the table is never pruned; found by review). Building it reads the table once and holds back its inserts
  meanwhile, as 0014's and 0015's do, which the stopped workers make harmless.

Rolling back restores the branch as 0022 left it and drops the index.

Revision ID: 0023
Revises: 0022
"""

from __future__ import annotations

from store.migrations.steps import edit_function, execute_each

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# The deferred check runs at commit, so it sees the evidence that the statement's own INSERT wrote (the parts of a
# data-modifying CTE do not see each other's rows, but the commit sees both). "The same transaction": the record's
# xmin is the job row's, as 0005's proofs test it.
GR1 = (
    ("            fits := NEW.rename_fence IS NOT DISTINCT FROM 'passed';\n"
     "            rule := 'only the rename fence may change, to passed';\n",
     "            fits := NEW.rename_fence IS NOT DISTINCT FROM 'passed'\n"
     "                AND EXISTS (SELECT 1 FROM public.export_attempt_events e\n"
     "                            JOIN public.export_jobs j ON j.id = e.job_id AND j.xmin = e.xmin\n"
     "                            WHERE e.job_id = NEW.id AND e.attempt_id = NEW.attempt_id\n"
     "                              AND e.kind = 'DeliveryEvidence' AND e.worker_id = NEW.claimed_by);\n"
     "            rule := 'only the rename fence may change, to passed, with the evidence of the attempt''s holder'\n"
     "                    ' in the same transaction';\n"),
)

UPGRADE = (
    "CREATE INDEX ix_attempt_events_evidence ON export_attempt_events (job_id, attempt_id)"
    " WHERE kind = 'DeliveryEvidence'",
    edit_function("0023", "exports_job_change_has_its_event", GR1),
)

DOWNGRADE = (
    edit_function("0023", "exports_job_change_has_its_event", GR1, undo=True),
    "DROP INDEX ix_attempt_events_evidence",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

"""The evidence follow-up may settle an OutcomeUnknown export Completed, by proof, under its own event kind (LV2).

An interrupted delivery is OutcomeUnknown until evidence resolves it. Before this migration only a reconciliation
operator could resolve it; now a scheduled follow-up (run by the workers, as the application role) looks at the
partner again for a bounded time, and settles the export Completed where it reads back the expected file's
SHA-256 under its final name, or finds the partner's acknowledgment naming that SHA-256. Its proof is its own
event kind, `ConfirmedByFollowUp`, which:

- proves the move OutcomeUnknown -> Completed for the job's current attempt, as `Reconciled` does (GR1), and
  only that move: the event needs the row Completed, confirmed by `sha256` or `acknowledgment` (GR2), so no
  absence and no size can be recorded as the follow-up's proof;
- is the application's, not the reconciler's: the reconciler's policy already admits only its own kinds.

The statement that writes it (`store/sql/follow_up_confirm.sql`) also requires the SHA-256 the follow-up saw to be
the row's expected one. `evidence_follow_ups` keeps, per export, how often the follow-up looked and what it found
last, so operators see what is pending and what it concluded; the application may write it, the reconciler read it.

Rolling back to 0007 (0.2.0) turns the follow-up's events into `Reconciled` ones, observed by the follow-up,
since 0.2.0's rules know no other kind for that move; the look table is dropped.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from store.migrations.steps import Edits, edit_function, execute_each

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

KINDS_0004 = ("'Claimed', 'BuildStarted', 'DeliveryAuthorized', 'Stopped', 'Failed', 'Finished', "
              "'RequeuedByRecovery', 'StoppedByRecovery', 'AttemptsExhausted', 'ResolvedByRecovery', "
              "'Reconciled', 'Corrected', 'DeliveryEvidence'")
KINDS = KINDS_0004 + ", 'ConfirmedByFollowUp'"

# 0005's rule functions, edited in place, so that their text stays 0005's and is not copied here: GR1 takes the
# follow-up's kind as proof of the reconciliation's move; GR2 reads the row's confirmation and requires a content
# proof with that kind.
GR1 = (("kinds := '{Reconciled}';", "kinds := '{Reconciled,ConfirmedByFollowUp}';"),)
GR2 = (("SELECT j.status, j.attempt_id, j.claimed_by, j.failure_reason,",
        "SELECT j.status, j.attempt_id, j.claimed_by, j.failure_reason, j.confirmed_by,"),
       ("WHEN 'Corrected' THEN",
        "WHEN 'ConfirmedByFollowUp' THEN job.status = 'Completed' AND job.confirmed_by IN ('sha256', 'acknowledgment')"
        "\n            WHEN 'Corrected' THEN"))


def _edit_function(name: str, edits: Edits, *, undo: bool = False) -> str:
    return edit_function("0009", name, edits, undo=undo)


def _kinds(kinds: str) -> str:
    return f"""
ALTER TABLE export_attempt_events
    DROP CONSTRAINT export_attempt_events_kind_check,
    ADD CONSTRAINT export_attempt_events_kind_check CHECK (kind IN ({kinds}))"""


# One statement each: `op.execute` sends them one at a time, as asyncpg prepares them.
UPGRADE = (
    _kinds(KINDS),
    _edit_function("exports_job_change_has_its_event", GR1),
    _edit_function("exports_event_has_its_change", GR2),
    """
CREATE TABLE evidence_follow_ups (
    job_id         uuid PRIMARY KEY REFERENCES export_jobs (id),
    attempt_id     uuid NOT NULL,
    looks          int NOT NULL CHECK (looks > 0),
    first_look_at  timestamptz NOT NULL,
    last_look_at   timestamptz NOT NULL,
    finding        text NOT NULL
)""",
    "GRANT SELECT, INSERT, UPDATE ON evidence_follow_ups TO exports_app",
    "GRANT SELECT ON evidence_follow_ups TO exports_reconciler",
    # The follow-up lists OutcomeUnknown exports on every run: few rows, found without a scan of the table.
    "CREATE INDEX ix_export_jobs_outcome_unknown ON export_jobs (id) WHERE status = 'OutcomeUnknown'",
)

DOWNGRADE = (
    "DROP INDEX ix_export_jobs_outcome_unknown",
    "DROP TABLE evidence_follow_ups",
    # The owner writes this, so the rules (which bind every other role) let it through.
    """
UPDATE export_attempt_events SET kind = 'Reconciled', observed_by = coalesce(observed_by, 'follow-up')
WHERE kind = 'ConfirmedByFollowUp'""",
    _edit_function("exports_event_has_its_change", GR2, undo=True),
    _edit_function("exports_job_change_has_its_event", GR1, undo=True),
    _kinds(KINDS_0004),
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

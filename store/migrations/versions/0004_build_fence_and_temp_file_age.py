"""Fenced builds, an agreed age for temporary files at the partner, and how each Completed was confirmed.

- `BuildStarted`: every build of an attempt (the first, and each resumption after its worker went quiet) takes
  the attempt's build slot with one conditional statement that records the build's holder in `claimed_by` and
  this event, naming the holder. From that commit, the earlier build's renewals and writes, which match their own
  holder, match no row. An attempt may be built several times, so the event is not a one-per-attempt transition.
- `destinations.temp_file_max_age_seconds`: the age after which the partner agreed that a temporary file of ours
  may be removed. Recovery cannot tell a dead worker from a paused one, so cleanup keys on this age, which must
  stay far above the deliver activity's six-hour timeout (the check allows no less than twelve hours).
- `export_jobs.confirmed_by`: what made a Completed true (sha256, the partner's acknowledgment, size where the
  contract accepts size, a reconciliation, a correction), so that operators can filter on it. A check ties it to
  Completed. Existing Completed rows get it from the event that settled them.
- `export_jobs.rejection_reason`: why policy refused an export, written by the rejection itself, so that the
  row (and `exports show`) says it, not only the worker's log. A check ties it to Rejected; rows rejected before
  this migration say that their reason was not recorded.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

EVENT_KINDS = ("'Claimed', 'BuildStarted', 'DeliveryAuthorized', 'Stopped', 'Failed', 'Finished', "
               "'RequeuedByRecovery', 'StoppedByRecovery', 'AttemptsExhausted', 'ResolvedByRecovery', "
               "'Reconciled', 'Corrected', 'DeliveryEvidence'")


def upgrade() -> None:
    op.execute(f"""
        ALTER TABLE export_attempt_events
            DROP CONSTRAINT export_attempt_events_kind_check,
            ADD CONSTRAINT export_attempt_events_kind_check CHECK (kind IN ({EVENT_KINDS}))
    """)
    op.execute("DROP INDEX uq_attempt_transition")
    op.execute("""
        CREATE UNIQUE INDEX uq_attempt_transition ON export_attempt_events (job_id, attempt_id, kind)
            WHERE kind NOT IN ('DeliveryEvidence', 'BuildStarted')
    """)
    op.execute("""
        ALTER TABLE destinations
            ADD COLUMN temp_file_max_age_seconds int NOT NULL DEFAULT 604800
                CONSTRAINT ck_destinations_temp_file_max_age CHECK (temp_file_max_age_seconds >= 43200)
    """)
    op.execute("""
        ALTER TABLE export_jobs ADD COLUMN confirmed_by text
            CONSTRAINT ck_export_jobs_confirmed_by
                CHECK (confirmed_by IN ('sha256', 'acknowledgment', 'size', 'reconciliation', 'correction'))
    """)
    # The latest settling event of each Completed row says how it was confirmed.
    op.execute("""
        UPDATE export_jobs j SET confirmed_by = CASE
            WHEN e.kind = 'Corrected' THEN 'correction'
            WHEN e.kind = 'Reconciled' THEN 'reconciliation'
            WHEN e.detail LIKE '%confirmed by sha256%' THEN 'sha256'
            WHEN e.detail LIKE '%acknowledgment%' THEN 'acknowledgment'
            ELSE 'size' END
        FROM (SELECT DISTINCT ON (job_id) job_id, kind, detail FROM export_attempt_events
              WHERE kind IN ('Finished', 'ResolvedByRecovery', 'Reconciled', 'Corrected')
              ORDER BY job_id, id DESC) e
        WHERE e.job_id = j.id AND j.status = 'Completed'
    """)
    op.execute("UPDATE export_jobs SET confirmed_by = 'size' WHERE status = 'Completed' AND confirmed_by IS NULL")
    op.execute("""
        ALTER TABLE export_jobs ADD CONSTRAINT ck_export_jobs_confirmed
            CHECK ((status = 'Completed') = (confirmed_by IS NOT NULL))
    """)
    op.execute("ALTER TABLE export_jobs ADD COLUMN rejection_reason text")
    op.execute("UPDATE export_jobs SET rejection_reason = 'not recorded (rejected before reasons were kept)' "
               "WHERE status = 'Rejected'")
    op.execute("""
        ALTER TABLE export_jobs ADD CONSTRAINT ck_export_jobs_rejection
            CHECK ((status = 'Rejected') = (rejection_reason IS NOT NULL))
    """)


def downgrade() -> None:
    op.execute("ALTER TABLE export_jobs DROP COLUMN rejection_reason, DROP COLUMN confirmed_by")
    op.execute("ALTER TABLE destinations DROP COLUMN temp_file_max_age_seconds")
    op.execute("DELETE FROM export_attempt_events WHERE kind = 'BuildStarted'")
    op.execute("DROP INDEX uq_attempt_transition")
    op.execute("""
        CREATE UNIQUE INDEX uq_attempt_transition ON export_attempt_events (job_id, attempt_id, kind)
            WHERE kind <> 'DeliveryEvidence'
    """)
    op.execute(f"""
        ALTER TABLE export_attempt_events
            DROP CONSTRAINT export_attempt_events_kind_check,
            ADD CONSTRAINT export_attempt_events_kind_check
                CHECK (kind IN ({EVENT_KINDS.replace("'BuildStarted', ", "")}))
    """)

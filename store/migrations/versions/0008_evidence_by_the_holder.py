"""Delivery evidence names its holder only where the database saw it hold the attempt (FG1).

Recovery resolves a Delivering attempt whose worker went quiet from the evidence that attempt appended: a
receipt saying the partner has the expected file settles it Completed. Before this migration any role that may
insert DeliveryEvidence (the application, the reconciler) could append a receipt for any attempt, and recovery
took the last one whatever its author, so a reconciler could complete an export that was never uploaded.

Now the database stamps provenance on every DeliveryEvidence row, whatever the writer sent: `worker_id` keeps the
holder the writer named only if, as the insert sees the job, that attempt is the job's current one, the job is
Delivering, and the name is its holder (`claimed_by`, the build that was authorized). Otherwise `worker_id` is
NULL: the record is kept for people, and recovery ignores it. The reconciler may still append evidence, but never
with a holder: its policy refuses a row the stamp left with one. Recovery trusts only records with a holder
(activities/evidence.py).

Known limit: the workers share one database role, so a worker could name another worker's current holder. The
rule binds evidence to the attempt that holds the row, not to a process; the application role is trusted with
the attempts it runs.

Rows written before this migration have no holder (0.2.0 wrote none): an attempt in flight across the upgrade
whose worker then dies is resolved from recovery's own look at the partner, not from its receipt.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# One statement each: `op.execute` sends them one at a time, as asyncpg prepares them (no script runner needed).
UPGRADE = (
    """
CREATE FUNCTION exports_evidence_holder() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.kind = 'DeliveryEvidence' THEN
        NEW.worker_id := (SELECT j.claimed_by FROM public.export_jobs j
                          WHERE j.id = NEW.job_id AND j.attempt_id = NEW.attempt_id AND j.status = 'Delivering'
                            AND j.claimed_by = NEW.worker_id);
    END IF;
    RETURN NEW;
END $$""",
    """
CREATE TRIGGER t_evidence_holder BEFORE INSERT ON export_attempt_events
    FOR EACH ROW EXECUTE FUNCTION exports_evidence_holder()""",
    # Policies are checked after BEFORE triggers: the reconciler's evidence can never carry a holder.
    """
ALTER POLICY p_events_reconciler ON export_attempt_events
    WITH CHECK (kind IN ('Corrected', 'Reconciled') OR (kind = 'DeliveryEvidence' AND worker_id IS NULL))""",
)

DOWNGRADE = (
    """
ALTER POLICY p_events_reconciler ON export_attempt_events
    WITH CHECK (kind IN ('Corrected', 'Reconciled', 'DeliveryEvidence'))""",
    "DROP TRIGGER t_evidence_holder ON export_attempt_events",
    "DROP FUNCTION exports_evidence_holder()",
)


def upgrade() -> None:
    for sql in UPGRADE:
        op.execute(sql)


def downgrade() -> None:
    for sql in DOWNGRADE:
        op.execute(sql)

"""The database refuses a change without its event (GR1) and an event without its change (GR2).

How, for every role but the tables' owner (a superuser counts as the owner: it is a member of every role):

- A deferred constraint trigger on export_jobs checks each transition at commit: the move (old status -> new
  status) must be one of the documented statements', it may change no column but that statement's (a column
  added later is frozen too), and the same transaction must have inserted its proof: the attempt event of the
  right kind for the right attempt or, for a cancellation or a stop request, the cancellation request.
  "The same transaction" is tested with nothing a role could forge with set_config: the proof row's xmin
  equals the xmin of the job row's current version, which at commit is this transaction's own write (the
  trigger fired for it, and the row lock is held). Comparing the two rows rather than pg_current_xact_id() also
  holds inside a savepoint, as long as the change and its proof are written in the same one, as every
  documented statement does (one statement, or cancellation's one transaction). Deferred, because cancellation
  updates the row before it inserts the request.
- Its WHEN clause keeps the two frequent writes free of any check: a renewal (only lease_expires_at, to a
  non-NULL value, on a Running or Delivering row) and a queued row's own edits (terms edit, sweep: only
  destination_id, version, woken_at, sweep_count). A transition queues one check: at commit, an index probe
  for its proof and one of the job's primary key. The WHEN function lists columns: a column added later that
  must not change in a renewal or a queued edit has to be added there.
- A deferred constraint trigger on export_attempt_events refuses a transition event (every kind but
  DeliveryEvidence) unless the same transaction changed its job row (the same xmin test) into the state the
  kind records, for that attempt: two primary-key probes at commit. A requeue event must name an attempt that
  was claimed, since a queued row's own edits change the row without a transition.
- Row-level security keeps each role to its kinds (the application never Reconciled nor Corrected; the
  reconciler only Reconciled, Corrected, DeliveryEvidence; the dispatcher has no INSERT at all), and column
  grants keep the application off a job's identity and the reconciler to status and failure_reason.
- A BEFORE UPDATE trigger on outbox makes published_at write-once, from NULL, stamped with the database clock
  whatever the writer sent.
- A deferred constraint trigger on export_jobs' inserts: a new job is Queued, with nothing of an attempt, and its
  outbox row was written by the same transaction (the creation statements do both), so no role can insert a
  job that is already settled, or a queued one with no wake-up on its way.

Refusals raise insufficient_privilege (42501) with a one-line message naming the rule; store/errors.py turns
that into NotPermitted.

Queued -> Rejected needs no proof: a rejection ends a job that never ran, so there is no attempt for an event to
name (an event's attempt_id is NOT NULL); reject.sql's version condition is its guard, it writes only status,
and the row is settled from then on.

The checks run with the writer's own privileges (they read only what the writer may read), name their tables
with the schema so that a temporary table cannot stand in for the history, and ask whether the writer is the
owner only before refusing, so that the application's own transitions never pay for that lookup.

Known limits: a transaction that writes the change and its proof in different savepoints is refused; an event
that fits the row's new state can ride along with a legitimate change of that row (a second kind for the same
transition, or a BuildStarted naming the current holder next to a renewal), adding history but never changing
state.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from typing import cast

from alembic import context, op
from sqlalchemy.engine.interfaces import AdaptedConnection

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# Written by the application's statements; a job's identity columns are not among them.
APP_COLUMNS = ("status, version, destination_id, attempt_id, attempt_count, claimed_by, lease_expires_at, "
               "stop_request_id, cancellation_request_id, expected_file_name, expected_file_bytes, "
               "expected_file_sha256, delivery_authorized_at, woken_at, failure_reason, sweep_count, confirmed_by, "
               "rejection_reason")

GRANTS = f"""
REVOKE UPDATE ON export_jobs FROM exports_app, exports_reconciler;
GRANT UPDATE ({APP_COLUMNS}) ON export_jobs TO exports_app;
GRANT UPDATE (status, failure_reason, confirmed_by) ON export_jobs TO exports_reconciler;

ALTER POLICY p_events_app ON export_attempt_events WITH CHECK (kind NOT IN ('Corrected', 'Reconciled'));
"""

# A build's proof is looked up by attempt: BuildStarted is outside uq_attempt_transition (several per attempt).
INDEXES = """
CREATE INDEX ix_attempt_builds ON export_attempt_events (job_id, attempt_id) WHERE kind = 'BuildStarted';
"""

OWNER = """
-- The tables' owner, or a superuser (a member of every role), arranges and repairs rows: the rules bind
-- everyone else. Not SECURITY DEFINER, so current_user is the role that wrote.
CREATE FUNCTION exports_by_owner(rel oid) RETURNS boolean LANGUAGE sql STABLE
AS $$ SELECT pg_has_role(current_user, c.relowner, 'MEMBER') FROM pg_catalog.pg_class c WHERE c.oid = rel $$;
"""

JOB_RULE = r"""
CREATE FUNCTION exports_job_change_has_its_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    move           text := OLD.status || ' -> ' || NEW.status;
    kinds          text[];                  -- the event kinds that prove this move; NULL: no event
    attempt        uuid := NEW.attempt_id;  -- the attempt the event names
    frozen         public.export_jobs := NEW;  -- NEW with this move's own columns put back: must equal OLD
    fits           boolean := true;         -- what else the move's statement guarantees,
    rule           text;                    -- said in words
    proof_request  uuid;  -- the cancellation request that proves a cancel or a stop request,
    proof_outcome  text;                    -- and the outcome it records
    one_kind       text;
    proved         boolean;
    refusal        text;
BEGIN
    <<checks>>
    BEGIN
        CASE
        WHEN OLD.status = 'Queued' AND NEW.status = 'Running' THEN  -- claim.sql
            kinds := '{Claimed}';
            frozen.status := OLD.status; frozen.attempt_id := OLD.attempt_id;
            frozen.attempt_count := OLD.attempt_count; frozen.claimed_by := OLD.claimed_by;
            frozen.lease_expires_at := OLD.lease_expires_at;
            fits := NEW.attempt_count = OLD.attempt_count + 1 AND NEW.lease_expires_at IS NOT NULL;
            rule := 'a claim counts one attempt and takes a lease';
        WHEN OLD.status = 'Queued' AND NEW.status = 'Rejected' THEN  -- reject.sql
            frozen.status := OLD.status; frozen.rejection_reason := OLD.rejection_reason;
        WHEN OLD.status = 'Queued' AND NEW.status = 'Canceled' THEN  -- cancel_queued.sql
            frozen.status := OLD.status; frozen.cancellation_request_id := OLD.cancellation_request_id;
            proof_request := NEW.cancellation_request_id; proof_outcome := 'CanceledWhileQueued';
        WHEN OLD.status = 'Running' AND NEW.status = 'Running'
             AND NEW.stop_request_id IS DISTINCT FROM OLD.stop_request_id THEN  -- request_stop.sql
            frozen.stop_request_id := OLD.stop_request_id;
            fits := OLD.stop_request_id IS NULL;
            rule := 'only the first stop request is kept';
            proof_request := NEW.stop_request_id; proof_outcome := 'StopRequested';
        WHEN OLD.status = 'Running' AND NEW.status = 'Running' THEN  -- build_start.sql
            kinds := '{BuildStarted}';
            frozen.claimed_by := OLD.claimed_by; frozen.lease_expires_at := OLD.lease_expires_at;
            fits := NEW.lease_expires_at IS NOT NULL;
            rule := 'a build takes a lease';
        WHEN OLD.status = 'Running' AND NEW.status = 'Delivering' THEN  -- authorize_delivery
            kinds := '{DeliveryAuthorized}';
            frozen.status := OLD.status; frozen.expected_file_name := OLD.expected_file_name;
            frozen.expected_file_bytes := OLD.expected_file_bytes;
            frozen.expected_file_sha256 := OLD.expected_file_sha256;
            frozen.delivery_authorized_at := OLD.delivery_authorized_at;
            frozen.lease_expires_at := OLD.lease_expires_at;
        WHEN OLD.status = 'Running' AND NEW.status = 'Stopped' THEN  -- finish_stopped, recovery_stop
            kinds := '{Stopped,StoppedByRecovery}';
            frozen.status := OLD.status; frozen.lease_expires_at := OLD.lease_expires_at;
            fits := NEW.stop_request_id IS NOT NULL;  -- never a takeover or a shutdown written as a stop
            rule := 'a stop needs a recorded stop request';
        WHEN OLD.status = 'Running' AND NEW.status = 'Failed' THEN  -- finish_failed, recovery_exhausted
            kinds := '{Failed,AttemptsExhausted}';
            frozen.status := OLD.status; frozen.failure_reason := OLD.failure_reason;
            frozen.lease_expires_at := OLD.lease_expires_at;
        WHEN OLD.status = 'Running' AND NEW.status = 'Queued' THEN  -- recovery_requeue
            kinds := '{RequeuedByRecovery}';
            attempt := OLD.attempt_id;
            frozen.status := OLD.status; frozen.attempt_id := OLD.attempt_id;
            frozen.claimed_by := OLD.claimed_by; frozen.lease_expires_at := OLD.lease_expires_at;
            frozen.woken_at := OLD.woken_at;
            fits := NEW.attempt_id IS NULL AND NEW.claimed_by IS NULL AND NEW.lease_expires_at IS NULL;
            rule := 'a requeue clears the attempt, its holder and its lease';
        WHEN OLD.status = 'Delivering' AND NEW.status IN ('Completed', 'Failed', 'OutcomeUnknown') THEN
            kinds := '{Finished,ResolvedByRecovery}';  -- finish_delivery, recovery_resolve
            frozen.status := OLD.status; frozen.failure_reason := OLD.failure_reason;
            frozen.lease_expires_at := OLD.lease_expires_at; frozen.confirmed_by := OLD.confirmed_by;
        WHEN OLD.status = 'OutcomeUnknown' AND NEW.status IN ('Completed', 'Failed') THEN  -- reconcile.sql
            kinds := '{Reconciled}';
            frozen.status := OLD.status; frozen.failure_reason := OLD.failure_reason;
            frozen.confirmed_by := OLD.confirmed_by;
        WHEN OLD.status IN ('Completed', 'Failed') AND NEW.status IN ('Completed', 'Failed')
             AND NEW.status <> OLD.status THEN  -- correct.sql
            kinds := '{Corrected}';
            frozen.status := OLD.status; frozen.failure_reason := OLD.failure_reason;
            frozen.confirmed_by := OLD.confirmed_by;
        WHEN OLD.status IN ('Completed', 'Failed', 'Canceled', 'Rejected', 'Stopped') THEN
            refusal := format('export %s is settled (%s); it changes only by a correction', NEW.id, move);
            EXIT checks;
        ELSE
            refusal := format('export %s: %s is not a transition of a documented statement', NEW.id, move);
            EXIT checks;
        END CASE;

        -- Only the move's own columns: any other change would ride along unrecorded.
        IF frozen IS DISTINCT FROM OLD THEN
            SELECT format('export %s: %s may not write %s', NEW.id, move, string_agg(n.key, ', '))
            INTO refusal FROM jsonb_each(to_jsonb(frozen)) n, to_jsonb(OLD) o
            WHERE n.value IS DISTINCT FROM o -> n.key;
            EXIT checks;
        END IF;
        IF NOT fits THEN
            refusal := format('export %s: %s refused: %s', NEW.id, move, rule);
            EXIT checks;
        END IF;

        -- The proof, written by the transaction that wrote the row's current version. One kind per lookup,
        -- each an equality, so the cached generic plan probes uq_attempt_transition (whose predicate the last
        -- condition repeats) or ix_attempt_builds, and the primary key of export_jobs: nothing planned per call.
        IF proof_outcome IS NOT NULL THEN
            proved := proof_request IS NOT NULL;  -- asked first: a role may not read cancellation_requests
            IF proved THEN
                proved := EXISTS (
                    SELECT 1 FROM public.cancellation_requests c
                    JOIN public.export_jobs j ON j.id = c.job_id AND j.xmin = c.xmin
                    WHERE c.tenant_id = NEW.tenant_id AND c.id = proof_request AND c.job_id = NEW.id
                      AND c.outcome = proof_outcome);
            END IF;
        ELSE
            proved := kinds IS NULL;  -- a rejection needs none: see the module's docstring
            FOREACH one_kind IN ARRAY coalesce(kinds, '{}') LOOP
                IF one_kind = 'BuildStarted' THEN
                    proved := EXISTS (
                        SELECT 1 FROM public.export_attempt_events e
                        JOIN public.export_jobs j ON j.id = e.job_id AND j.xmin = e.xmin
                        WHERE e.job_id = NEW.id AND e.attempt_id = attempt AND e.kind = 'BuildStarted'
                          AND e.worker_id = NEW.claimed_by);
                ELSE
                    proved := EXISTS (
                        SELECT 1 FROM public.export_attempt_events e
                        JOIN public.export_jobs j ON j.id = e.job_id AND j.xmin = e.xmin
                        WHERE e.job_id = NEW.id AND e.attempt_id = attempt AND e.kind = one_kind
                          AND (one_kind <> 'Claimed' OR e.worker_id = NEW.claimed_by)
                          AND e.kind NOT IN ('DeliveryEvidence', 'BuildStarted'));
                END IF;
                EXIT WHEN proved;
            END LOOP;
        END IF;
        IF NOT proved THEN
            refusal := format('export %s: %s needs its %s in the same transaction', NEW.id, move,
                              coalesce(array_to_string(kinds, ' or ') || ' event',
                                       'cancellation request (' || proof_outcome || ')'));
        END IF;
    END checks;

    -- Asked last: see the module's docstring.
    IF refusal IS NULL OR public.exports_by_owner(TG_RELID) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = 'GR1: ' || refusal;
END $$;

-- Whether an update needs the check: not the two frequent writes that change no state. A function rather than
-- the WHEN clause itself, because PostgreSQL rebuilds a trigger's WHEN expression for every statement, and this
-- one, written out, cost a renewal more than the rest of its work.
CREATE FUNCTION exports_job_change_is_checked(o export_jobs, n export_jobs) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF o.status = 'Queued' AND n.status = 'Queued' THEN
        -- A queued row's own edits (terms edit, sweep) change only destination_id, version, woken_at and
        -- sweep_count.
        RETURN (n.attempt_id, n.attempt_count, n.claimed_by, n.lease_expires_at, n.stop_request_id,
                n.cancellation_request_id, n.expected_file_name, n.expected_file_bytes, n.expected_file_sha256,
                n.delivery_authorized_at, n.failure_reason, n.confirmed_by, n.rejection_reason)
               IS DISTINCT FROM
               (o.attempt_id, o.attempt_count, o.claimed_by, o.lease_expires_at, o.stop_request_id,
                o.cancellation_request_id, o.expected_file_name, o.expected_file_bytes, o.expected_file_sha256,
                o.delivery_authorized_at, o.failure_reason, o.confirmed_by, o.rejection_reason);
    END IF;
    IF o.status IN ('Running', 'Delivering') AND n.lease_expires_at IS NOT NULL THEN
        -- A renewal changes only the lease, to a value, while the attempt holds the job.
        RETURN (n.status, n.version, n.destination_id, n.attempt_id, n.attempt_count, n.claimed_by,
                n.stop_request_id, n.cancellation_request_id, n.expected_file_name, n.expected_file_bytes,
                n.expected_file_sha256, n.delivery_authorized_at, n.woken_at, n.failure_reason, n.sweep_count,
                n.confirmed_by, n.rejection_reason)
               IS DISTINCT FROM
               (o.status, o.version, o.destination_id, o.attempt_id, o.attempt_count, o.claimed_by,
                o.stop_request_id, o.cancellation_request_id, o.expected_file_name, o.expected_file_bytes,
                o.expected_file_sha256, o.delivery_authorized_at, o.woken_at, o.failure_reason, o.sweep_count,
                o.confirmed_by, o.rejection_reason);
    END IF;
    RETURN true;
END $$;

CREATE CONSTRAINT TRIGGER tr_export_jobs_change_has_its_event
    AFTER UPDATE ON export_jobs DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (exports_job_change_is_checked(OLD, NEW))
    EXECUTE FUNCTION exports_job_change_has_its_event();
"""

EVENT_RULE = r"""
CREATE FUNCTION exports_event_has_its_change() RETURNS trigger LANGUAGE plpgsql
AS $$
DECLARE
    job   record;
    fits  boolean;
BEGIN
    SELECT j.status, j.attempt_id, j.claimed_by, j.failure_reason, j.xmin = e.xmin AS changed_here INTO job
    FROM public.export_attempt_events e JOIN public.export_jobs j ON j.id = e.job_id
    WHERE e.id = NEW.id;
    -- The row as this transaction left it must be the state the kind records, for this attempt. A requeue
    -- leaves no attempt on the row: its event must name one that was claimed.
    IF NEW.kind = 'RequeuedByRecovery' THEN
        fits := job.changed_here AND job.status = 'Queued' AND job.attempt_id IS NULL
                AND EXISTS (SELECT 1 FROM public.export_attempt_events c
                            WHERE c.job_id = NEW.job_id AND c.attempt_id = NEW.attempt_id AND c.kind = 'Claimed'
                              AND c.kind NOT IN ('DeliveryEvidence', 'BuildStarted'));
    ELSE
        fits := job.changed_here AND job.attempt_id = NEW.attempt_id AND CASE NEW.kind
            WHEN 'Claimed' THEN job.status = 'Running'
            WHEN 'BuildStarted' THEN job.status = 'Running' AND job.claimed_by = NEW.worker_id
            WHEN 'DeliveryAuthorized' THEN job.status = 'Delivering'
            WHEN 'Stopped' THEN job.status = 'Stopped'
            WHEN 'StoppedByRecovery' THEN job.status = 'Stopped'
            WHEN 'Failed' THEN job.status = 'Failed'
            WHEN 'AttemptsExhausted' THEN job.status = 'Failed' AND job.failure_reason = 'AttemptsExhausted'
            WHEN 'Finished' THEN job.status IN ('Completed', 'Failed', 'OutcomeUnknown')
            WHEN 'ResolvedByRecovery' THEN job.status IN ('Completed', 'OutcomeUnknown')
            WHEN 'Reconciled' THEN job.status IN ('Completed', 'Failed')
            WHEN 'Corrected' THEN job.status IN ('Completed', 'Failed')
            ELSE false END;
    END IF;
    IF fits OR public.exports_by_owner(TG_RELID) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
        'GR2: export %s: event %s needs its row change in the same transaction', NEW.job_id, NEW.kind);
END $$;

CREATE CONSTRAINT TRIGGER tr_attempt_events_event_has_its_change
    AFTER INSERT ON export_attempt_events DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.kind <> 'DeliveryEvidence')
    EXECUTE FUNCTION exports_event_has_its_change();
"""

# A job is born Queued, with nothing of an attempt, and with its wake-up: the creation statements write the job and
# its outbox row together. Without this, a role could insert a job that is already Completed, with no history.
CREATION_RULE = r"""
CREATE FUNCTION exports_new_job_is_queued_with_its_wakeup() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.status = 'Queued' AND NEW.attempt_id IS NULL AND NEW.attempt_count = 0 AND NEW.claimed_by IS NULL
        AND NEW.lease_expires_at IS NULL AND NEW.stop_request_id IS NULL AND NEW.cancellation_request_id IS NULL
        AND NEW.expected_file_name IS NULL AND NEW.expected_file_bytes IS NULL AND NEW.expected_file_sha256 IS NULL
        AND NEW.delivery_authorized_at IS NULL AND NEW.failure_reason IS NULL AND NEW.confirmed_by IS NULL
        AND NEW.rejection_reason IS NULL AND NEW.sweep_count = 0
        AND EXISTS (SELECT 1 FROM public.outbox o JOIN public.export_jobs j ON j.id = o.job_id AND j.xmin = o.xmin
                    WHERE o.job_id = NEW.id))
       OR public.exports_by_owner(TG_RELID) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
        'GR1: export %s: a new export is Queued, with nothing of an attempt, and with its wake-up', NEW.id);
END $$;

CREATE CONSTRAINT TRIGGER tr_export_jobs_created_queued
    AFTER INSERT ON export_jobs DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION exports_new_job_is_queued_with_its_wakeup();
"""

OUTBOX_RULE = r"""
CREATE FUNCTION exports_outbox_published_once() RETURNS trigger LANGUAGE plpgsql
AS $$
BEGIN
    IF public.exports_by_owner(TG_RELID) THEN
        RETURN NEW;
    END IF;
    IF OLD.published_at IS NOT NULL OR NEW.published_at IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = format(
            'GR2: outbox message %s: published_at is set once, from NULL', OLD.message_id);
    END IF;
    NEW.published_at := clock_timestamp();  -- the database's clock, never the writer's
    RETURN NEW;
END $$;

CREATE TRIGGER tr_outbox_published_once BEFORE UPDATE ON outbox
    FOR EACH ROW EXECUTE FUNCTION exports_outbox_published_once();
"""


def _script(sql: str) -> None:
    """Run a multi-statement script with the simple query protocol; asyncpg prepares one statement at a time.
    Offline (`exports migrate --sql`) there is no connection: the script is written out as it is, for psql."""
    if context.is_offline_mode():
        op.execute(sql)
        return
    # The asyncpg dialect's connection, the adapter that runs a coroutine on the driver's own connection.
    adapted = cast(AdaptedConnection, op.get_bind().connection.dbapi_connection)
    adapted.run_async(lambda conn: conn.execute(sql))


def upgrade() -> None:
    _script(GRANTS)
    _script(INDEXES)
    _script(OWNER)
    _script(JOB_RULE)
    _script(EVENT_RULE)
    _script(CREATION_RULE)
    _script(OUTBOX_RULE)


def downgrade() -> None:
    _script("""
        DROP TRIGGER tr_outbox_published_once ON outbox;
        DROP TRIGGER tr_export_jobs_created_queued ON export_jobs;
        DROP FUNCTION exports_new_job_is_queued_with_its_wakeup();
        DROP FUNCTION exports_outbox_published_once();
        DROP TRIGGER tr_attempt_events_event_has_its_change ON export_attempt_events;
        DROP FUNCTION exports_event_has_its_change();
        DROP TRIGGER tr_export_jobs_change_has_its_event ON export_jobs;
        DROP FUNCTION exports_job_change_has_its_event();
        DROP FUNCTION exports_job_change_is_checked(export_jobs, export_jobs);
        DROP FUNCTION exports_by_owner(oid);
        DROP INDEX ix_attempt_builds;
        ALTER POLICY p_events_app ON export_attempt_events WITH CHECK (kind <> 'Corrected');
        REVOKE UPDATE (status, failure_reason, confirmed_by) ON export_jobs FROM exports_reconciler;
        REVOKE UPDATE (""" + APP_COLUMNS + """) ON export_jobs FROM exports_app;
        GRANT UPDATE ON export_jobs TO exports_app, exports_reconciler;
    """)

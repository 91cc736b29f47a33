"""The five tables of the reference design, destinations, contacts, the database roles and their grants.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from typing import cast

from alembic import context, op
from sqlalchemy.engine.interfaces import AdaptedConnection

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Cluster-wide roles; created only if missing, so several databases on one server can share them.
ROLES = ("exports_app", "exports_dispatcher", "exports_reconciler")

SUPPORT_TABLES = """
CREATE TABLE destinations (
    id             uuid PRIMARY KEY,
    tenant_id      uuid NOT NULL,
    name           text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    host           text NOT NULL,
    port           int  NOT NULL CHECK (port BETWEEN 1 AND 65535),
    username       text NOT NULL,
    final_dir      text NOT NULL,                 -- where the partner processes final files
    temp_dir       text NOT NULL,                 -- where temporary files go; ignored by the partner
    host_key       text NOT NULL,                 -- the partner's pinned public host key, OpenSSH format
    credential_ref text NOT NULL,                 -- file:<path> or env:<VAR> naming the private key; never the key
    enabled        boolean NOT NULL DEFAULT true,
    CONSTRAINT uq_destinations_tenant UNIQUE (tenant_id, id)
);

-- Stands in for the CRM.
CREATE TABLE contacts (
    tenant_id   uuid NOT NULL,
    id          bigint GENERATED ALWAYS AS IDENTITY,
    email       text NOT NULL,
    first_name  text NOT NULL,
    last_name   text NOT NULL,
    phone       text,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT pk_contacts PRIMARY KEY (tenant_id, id)
);
"""

# The reference design's DDL, as written there, apart from the destination foreign key marked below.
DESIGN_TABLES = """
CREATE TABLE export_jobs (
    id                       uuid PRIMARY KEY,
    tenant_id                uuid NOT NULL,
    status                   text NOT NULL CHECK (status IN ('Queued', 'Running', 'Delivering', 'Canceled',
                                 'Rejected', 'Stopped', 'Failed', 'Completed', 'OutcomeUnknown')),
    version                  int  NOT NULL,
    destination_id           uuid NOT NULL,
    attempt_id               uuid,
    attempt_count            int  NOT NULL DEFAULT 0,
    claimed_by               text,
    lease_expires_at         timestamptz,
    stop_request_id          uuid,
    cancellation_request_id  uuid,
    expected_file_name       text,
    expected_file_bytes      bigint,
    expected_file_sha256     bytea,
    delivery_authorized_at   timestamptz,
    woken_at                 timestamptz NOT NULL,
    failure_reason           text CHECK (failure_reason IN ('BuildFailed', 'AttemptsExhausted', 'NotDelivered',
                                 'FinalNameOccupied', 'OriginalDelivered')),
    delivery_key             text NOT NULL,
    replaces_job_id          uuid,
    created_by               text NOT NULL,
    replacement_reason       text,
    overwrite_agreement_ref  text,
    sweep_count              int  NOT NULL DEFAULT 0,
    CONSTRAINT uq_export_jobs_tenant UNIQUE (tenant_id, id),
    CONSTRAINT ck_export_jobs_replacement CHECK ((replaces_job_id IS NULL) = (replacement_reason IS NULL)),
    CONSTRAINT ck_export_jobs_overwrite CHECK (overwrite_agreement_ref IS NULL OR replaces_job_id IS NOT NULL),
    CONSTRAINT ck_export_jobs_failure CHECK ((status = 'Failed') = (failure_reason IS NOT NULL)),
    -- Not in the reference design: a job names a destination of its own tenant.
    CONSTRAINT fk_export_jobs_destination FOREIGN KEY (tenant_id, destination_id)
        REFERENCES destinations (tenant_id, id)
);

CREATE TABLE deliveries (
    tenant_id        uuid NOT NULL,
    delivery_key     text NOT NULL,
    original_job_id  uuid NOT NULL,
    CONSTRAINT pk_deliveries PRIMARY KEY (tenant_id, delivery_key),
    CONSTRAINT uq_deliveries_original UNIQUE (tenant_id, delivery_key, original_job_id),
    CONSTRAINT fk_deliveries_original FOREIGN KEY (tenant_id, original_job_id)
        REFERENCES export_jobs (tenant_id, id) DEFERRABLE INITIALLY DEFERRED
);

ALTER TABLE export_jobs
    ADD CONSTRAINT fk_export_jobs_delivery FOREIGN KEY (tenant_id, delivery_key)
        REFERENCES deliveries (tenant_id, delivery_key),
    ADD CONSTRAINT fk_export_jobs_replaces FOREIGN KEY (tenant_id, delivery_key, replaces_job_id)
        REFERENCES deliveries (tenant_id, delivery_key, original_job_id);

CREATE UNIQUE INDEX uq_export_jobs_original_key ON export_jobs (tenant_id, delivery_key) WHERE replaces_job_id IS NULL;

CREATE UNIQUE INDEX uq_export_jobs_one_replacement ON export_jobs (tenant_id, replaces_job_id)
    WHERE replaces_job_id IS NOT NULL
      AND (status NOT IN ('Canceled', 'Rejected', 'Stopped', 'Failed') OR failure_reason = 'OriginalDelivered');

CREATE INDEX ix_export_jobs_lease ON export_jobs (lease_expires_at) WHERE status IN ('Running', 'Delivering');
CREATE INDEX ix_export_jobs_woken ON export_jobs (woken_at) WHERE status = 'Queued';

CREATE TABLE export_attempt_events (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       uuid NOT NULL REFERENCES export_jobs (id),
    attempt_id   uuid NOT NULL,
    kind         text NOT NULL CHECK (kind IN ('Claimed', 'DeliveryAuthorized', 'Stopped', 'Failed',
                     'Finished', 'RequeuedByRecovery', 'StoppedByRecovery', 'AttemptsExhausted',
                     'ResolvedByRecovery', 'Reconciled', 'Corrected', 'DeliveryEvidence')),
    version      int,
    worker_id    text,
    observed_by  text,
    detail       text,
    recorded_at  timestamptz NOT NULL
);

CREATE UNIQUE INDEX uq_attempt_transition ON export_attempt_events (job_id, attempt_id, kind)
    WHERE kind <> 'DeliveryEvidence';

CREATE TABLE cancellation_requests (
    tenant_id                     uuid NOT NULL,
    id                            uuid NOT NULL,
    job_id                        uuid NOT NULL,
    requested_by                  text NOT NULL,
    reason                        text,
    outcome                       text NOT NULL,
    found_status                  text NOT NULL,
    found_attempt_id              uuid,
    found_attempt_count           int  NOT NULL,
    found_delivery_authorized_at  timestamptz,
    recorded_at                   timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT pk_cancellation_requests PRIMARY KEY (tenant_id, id),
    CONSTRAINT fk_cancellation_requests_job FOREIGN KEY (tenant_id, job_id)
        REFERENCES export_jobs (tenant_id, id)
);

CREATE TABLE outbox (
    message_id    uuid PRIMARY KEY,
    kind          text NOT NULL,
    job_id        uuid NOT NULL,
    created_at    timestamptz NOT NULL,
    published_at  timestamptz
);

-- Not in the reference design: the dispatcher's scan of unpublished rows stays small as the outbox grows.
CREATE INDEX ix_outbox_unpublished ON outbox (created_at) WHERE published_at IS NULL;
"""

NOTIFICATIONS = """
-- The dispatcher LISTENs, so a new wake-up is published at once rather than at the next poll.
CREATE FUNCTION notify_outbox_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('exports_outbox', NEW.job_id::text);
    RETURN NULL;
END $$;
CREATE TRIGGER tr_outbox_notify AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION notify_outbox_insert();
"""

GRANTS = """
GRANT USAGE ON SCHEMA public TO exports_app, exports_dispatcher, exports_reconciler;

-- The application: jobs are updated only by conditional statements and never deleted; the history tables and
-- deliveries are append-only; the outbox is insert-only.
GRANT SELECT, INSERT, UPDATE ON export_jobs TO exports_app;
GRANT SELECT, INSERT ON deliveries, export_attempt_events, cancellation_requests, outbox TO exports_app;
GRANT SELECT ON destinations, contacts TO exports_app;

-- The dispatcher: reads the outbox and changes only its publication status.
GRANT SELECT ON outbox TO exports_dispatcher;
GRANT UPDATE (published_at) ON outbox TO exports_dispatcher;

-- Reconciliation operators: corrections and reconciliations of recorded outcomes.
GRANT SELECT, UPDATE ON export_jobs TO exports_reconciler;
GRANT SELECT, INSERT ON export_attempt_events TO exports_reconciler;

-- A correction's event may be written only by the reconciliation role, so the correction statement, which
-- inserts that event in the same statement as its update, fails whole for everyone else.
ALTER TABLE export_attempt_events ENABLE ROW LEVEL SECURITY;
CREATE POLICY p_events_read ON export_attempt_events FOR SELECT
    TO exports_app, exports_reconciler USING (true);
CREATE POLICY p_events_app ON export_attempt_events FOR INSERT
    TO exports_app WITH CHECK (kind <> 'Corrected');
CREATE POLICY p_events_reconciler ON export_attempt_events FOR INSERT
    TO exports_reconciler WITH CHECK (kind IN ('Corrected', 'Reconciled', 'DeliveryEvidence'));
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
    for role in ROLES:
        op.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
            f"THEN CREATE ROLE {role} LOGIN; END IF; END $$"
        )
    _script(SUPPORT_TABLES)
    _script(DESIGN_TABLES)
    _script(NOTIFICATIONS)
    _script(GRANTS)


def downgrade() -> None:
    _script(
        "DROP TABLE outbox, cancellation_requests, export_attempt_events, deliveries, export_jobs, contacts, "
        "destinations CASCADE; DROP FUNCTION notify_outbox_insert()"
    )

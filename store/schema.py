"""SQLAlchemy Core metadata for the tables the migrations create. Queries are built from these or read from sql/."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP, UUID

metadata = MetaData()
tstz = TIMESTAMP(timezone=True)

destinations = Table(
    "destinations",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("name", Text, nullable=False),
    Column("host", Text, nullable=False),
    Column("port", Integer, nullable=False),
    Column("username", Text, nullable=False),
    Column("final_dir", Text, nullable=False),
    Column("temp_dir", Text, nullable=False),
    Column("host_key", Text, nullable=False),
    Column("credential_ref", Text, nullable=False),
    Column("enabled", Boolean, nullable=False),
    Column("name_and_size_identify", Boolean, nullable=False),
    Column("hash_evidence", Text, nullable=False),
    Column("acknowledgment_dir", Text),
    Column("temp_file_max_age_seconds", Integer, nullable=False),
    Column("max_sessions", Integer),  # migration 0011: how many sessions the partner accepts at once (None: no limit)
)

contacts = Table(
    "contacts",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), primary_key=True),
    Column("id", BigInteger, primary_key=True),
    Column("email", Text, nullable=False),
    Column("first_name", Text, nullable=False),
    Column("last_name", Text, nullable=False),
    Column("phone", Text),
    Column("updated_at", tstz, nullable=False),
)

export_jobs = Table(
    "export_jobs",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("status", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("destination_id", UUID(as_uuid=True), nullable=False),
    Column("attempt_id", UUID(as_uuid=True)),
    Column("attempt_count", Integer, nullable=False),
    Column("claimed_by", Text),
    Column("lease_expires_at", tstz),
    Column("stop_request_id", UUID(as_uuid=True)),
    Column("cancellation_request_id", UUID(as_uuid=True)),
    Column("expected_file_name", Text),
    Column("expected_file_bytes", BigInteger),
    Column("expected_file_sha256", LargeBinary),
    Column("delivery_authorized_at", tstz),
    Column("woken_at", tstz, nullable=False),
    Column("failure_reason", Text),
    Column("delivery_key", Text, nullable=False),
    Column("replaces_job_id", UUID(as_uuid=True)),
    Column("created_by", Text, nullable=False),
    Column("replacement_reason", Text),
    Column("overwrite_agreement_ref", Text),
    Column("sweep_count", Integer, nullable=False),
    Column("confirmed_by", Text),
    Column("rejection_reason", Text),
    Column("final_name", Text, nullable=False),
    Column("rename_fence", Text),  # migration 0010: NULL, open (at cutoff 2) or passed (right before the rename)
    # migration 0013: attempts handed back by their worker before the rename (they do not count toward the cap)
    Column("handed_back_count", Integer, nullable=False),
    # migration 0017: the attempt whose upload a run waits on (its terminal write wakes the run)
    Column("run_waits_for", UUID(as_uuid=True)),
    # migration 0018: the last attempt whose hand-back was counted
    Column("handed_back_attempt", UUID(as_uuid=True)),
    # migration 0022: the attempt whose cutoff 2 its run gave up (cutoff 2 refuses it)
    Column("cutoff_2_given_up", UUID(as_uuid=True)),
)

deliveries = Table(
    "deliveries",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), primary_key=True),
    Column("delivery_key", Text, primary_key=True),
    Column("original_job_id", UUID(as_uuid=True), nullable=False),
)

export_attempt_events = Table(
    "export_attempt_events",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("job_id", UUID(as_uuid=True), nullable=False),
    Column("attempt_id", UUID(as_uuid=True), nullable=False),
    Column("kind", Text, nullable=False),
    Column("version", Integer),
    Column("worker_id", Text),
    Column("observed_by", Text),
    Column("detail", Text),
    Column("recorded_at", tstz, nullable=False),
)

cancellation_requests = Table(
    "cancellation_requests",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), primary_key=True),
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("job_id", UUID(as_uuid=True), nullable=False),
    Column("requested_by", Text, nullable=False),
    Column("reason", Text),
    Column("outcome", Text, nullable=False),
    Column("found_status", Text, nullable=False),
    Column("found_attempt_id", UUID(as_uuid=True)),
    Column("found_attempt_count", Integer, nullable=False),
    Column("found_delivery_authorized_at", tstz),
    Column("recorded_at", tstz, nullable=False),
)

outbox = Table(
    "outbox",
    metadata,
    Column("message_id", UUID(as_uuid=True), primary_key=True),
    Column("kind", Text, nullable=False),
    Column("job_id", UUID(as_uuid=True), nullable=False),
    Column("created_at", tstz, nullable=False),
    Column("published_at", tstz),
)

evidence_follow_ups = Table(
    "evidence_follow_ups",
    metadata,
    Column("job_id", UUID(as_uuid=True), primary_key=True),
    Column("attempt_id", UUID(as_uuid=True), nullable=False),
    Column("looks", Integer, nullable=False),
    Column("first_look_at", tstz, nullable=False),
    Column("last_look_at", tstz, nullable=False),
    Column("finding", Text, nullable=False),
)

# Migration 0011: a slot of a destination's session limit, held while its export's row names the attempt, Running
# or Delivering, or while its upload keeps it (0016: until `uploading_until`) (take_partner_session.sql).
partner_sessions = Table(
    "partner_sessions",
    metadata,
    Column("destination_id", UUID(as_uuid=True), primary_key=True),
    Column("slot", Integer, primary_key=True),
    Column("job_id", UUID(as_uuid=True), nullable=False),
    Column("attempt_id", UUID(as_uuid=True), nullable=False),
    Column("taken_at", tstz, nullable=False),
    Column("uploading_until", tstz),
)

# Migration 0020: the attempts waiting for a session at a destination with a limit, in the order they began
# (take_partner_session.sql).
partner_session_waits = Table(
    "partner_session_waits",
    metadata,
    Column("job_id", UUID(as_uuid=True), primary_key=True),
    Column("attempt_id", UUID(as_uuid=True), primary_key=True),
    Column("destination_id", UUID(as_uuid=True), nullable=False),
    Column("since", tstz, nullable=False),
    Column("asked_at", tstz, nullable=False),
)

"""A partner's session limit (LD3): a destination's contract may say how many sessions its partner accepts at once
(OpenSSH's MaxSessions and MaxStartups, a hosted service's per-user limit), and no more uploads than that run to it
across all workers.

- `destinations.max_sessions`: NULL (no limit, as before) or 1 to 1000.
- `partner_sessions`: one row per slot of a destination, naming the attempt that holds it. A slot is held while
  its export's row still names that attempt, Running or Delivering: the attempt's own terminal write, or recovery's
  takeover, frees it with no write here, so a worker that dies holding a slot never holds it for good. The
  application takes a free (or freed) slot with one statement (take_partner_session.sql), before cutoff 2, and
  deletes its row when its attempt ends on the worker (an early release, for speed only).

Rolling back drops both; earlier releases upload with no session limit.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

UPGRADE = (
    "ALTER TABLE destinations ADD COLUMN max_sessions integer"
    " CHECK (max_sessions IS NULL OR max_sessions BETWEEN 1 AND 1000)",
    """
CREATE TABLE partner_sessions (
    destination_id uuid NOT NULL REFERENCES destinations (id) ON DELETE CASCADE,
    slot integer NOT NULL CHECK (slot BETWEEN 1 AND 1000),
    job_id uuid NOT NULL REFERENCES export_jobs (id),
    attempt_id uuid NOT NULL,
    taken_at timestamptz NOT NULL,
    PRIMARY KEY (destination_id, slot),
    UNIQUE (job_id, attempt_id)
)""",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON partner_sessions TO exports_app",
    "GRANT SELECT ON partner_sessions TO exports_reconciler",
)

DOWNGRADE = (
    "DROP TABLE partner_sessions",
    "ALTER TABLE destinations DROP COLUMN max_sessions",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

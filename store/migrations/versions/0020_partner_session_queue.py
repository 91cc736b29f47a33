"""A partner's sessions go to the exports that have waited longest (LD3).

An export waiting at cutoff 2 for a session at a partner that limits them asked again every second, and a freed
slot went to whoever asked first after it was freed: how long an export had waited played no part. With uploads
of a steady length, the same waiter could be overtaken round after round by exports that began waiting after it,
up to its step's 6-hour bound, however short the backlog ahead of it was.

- `partner_session_waits`: one row per attempt that has asked for a session at a destination with a limit: since
  when it waits (its first ask) and when it last asked. take_partner_session.sql writes it at each ask and gives a
  slot only while fewer slots are live than the limit less the live waiters ahead of it: those that asked first,
  still ask (within the last few seconds), hold no slot yet, and whose export's row still names their attempt. A
  waiter that stops asking (its worker gone or paused) holds no one back; its row is deleted with its attempt's
  session (release_partner_session.sql), or by a later ask at its destination once it has been silent for long.
- The application may select, insert, update and delete its rows; the reconciler may read them.

The order is fairness, not the limit: the slots' own rows still decide, under their row locks, that no more than
the limit are live. Rolling back drops the table; earlier releases give a freed slot to whoever asks first.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

UPGRADE = (
    """
CREATE TABLE partner_session_waits (
    job_id uuid NOT NULL REFERENCES export_jobs (id),
    attempt_id uuid NOT NULL,
    destination_id uuid NOT NULL REFERENCES destinations (id) ON DELETE CASCADE,
    since timestamptz NOT NULL,
    asked_at timestamptz NOT NULL,
    PRIMARY KEY (job_id, attempt_id)
)""",
    "CREATE INDEX ix_partner_session_waits_queue ON partner_session_waits (destination_id, since, job_id)",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON partner_session_waits TO exports_app",
    "GRANT SELECT ON partner_session_waits TO exports_reconciler",
)

DOWNGRADE = (
    "DROP TABLE partner_session_waits",
)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

"""A reconciliation or correction wakes the export's workflow, as every other writer does, through the outbox:
the dispatcher publishes the row, and a run (a new one if the workflow had closed) reads the row again, so its
search attributes and result follow the corrected state.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("GRANT INSERT ON outbox TO exports_reconciler")


def downgrade() -> None:
    op.execute("REVOKE INSERT ON outbox FROM exports_reconciler")

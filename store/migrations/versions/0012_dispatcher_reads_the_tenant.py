"""The dispatcher keys each export's workflow to its tenant (LD5): it reads the tenant of the export it wakes.

When it starts an export's workflow, the dispatcher sets the run's fairness key to the export's tenant, so that the
run's steps (its claim waiting on the admission queue above all) are dispatched fairly between tenants where the
Temporal server has fairness on: one tenant's burst no longer holds back another tenant's export. It reads the
tenant with the outbox row it publishes, which needs SELECT on two columns of export_jobs, and only those: the
dispatcher still writes nothing but `outbox.published_at`.

Rolling back revokes the read; earlier releases' dispatchers do not ask for it.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from store.migrations.steps import execute_each

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

UPGRADE = ("GRANT SELECT (id, tenant_id) ON export_jobs TO exports_dispatcher",)

DOWNGRADE = ("REVOKE SELECT (id, tenant_id) ON export_jobs FROM exports_dispatcher",)


def upgrade() -> None:
    execute_each(UPGRADE)


def downgrade() -> None:
    execute_each(DOWNGRADE)

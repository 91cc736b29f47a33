"""How the outside world addresses an export's workflow: its ID, its priority and its search attributes."""

from __future__ import annotations

import re
import uuid

from temporalio.common import Priority, SearchAttributeKey

EXPORT_WORKFLOW_PREFIX = "export-"
_EXPORT_WORKFLOW_ID = re.compile(r"^export-([0-9a-fA-F-]{36})$")


def export_workflow_id(job_id: object) -> str:
    """The one workflow of an export: `export-<job id>`. Its start, signals and queries all go to this ID."""
    return f"{EXPORT_WORKFLOW_PREFIX}{job_id}"


def job_id_of(workflow_id: object) -> str | None:
    """The export's ID when the workflow ID is `export-<uuid>`, else None (recovery, sweeper, ...)."""
    found = _EXPORT_WORKFLOW_ID.match(workflow_id) if isinstance(workflow_id, str) else None
    if found is None:
        return None
    try:
        return str(uuid.UUID(found.group(1)))
    except ValueError:
        return None


def tenant_priority(tenant_id: object | None) -> Priority:
    """An export run's priority: its tenant as the fairness key (a UUID's 36 characters, within Temporal's 64
    bytes), so that where the server has fairness on, each tenant's steps get their share of the workers and one
    tenant's burst does not hold back another's export (LD5). Without a tenant, the default (an empty key)."""
    return Priority(fairness_key=str(tenant_id)) if tenant_id is not None else Priority.default


EXPORT_STATUS = SearchAttributeKey.for_keyword("ExportStatus")
EXPORT_TENANT = SearchAttributeKey.for_keyword("ExportTenant")
DELIVERY_KEY = SearchAttributeKey.for_keyword("DeliveryKey")
EXPORT_ATTEMPTS = SearchAttributeKey.for_int("ExportAttempts")
# How a Completed was confirmed (sha256, acknowledgment, size, reconciliation, correction); absent otherwise.
EXPORT_CONFIRMED_BY = SearchAttributeKey.for_keyword("ExportConfirmedBy")
SEARCH_ATTRIBUTES = (EXPORT_STATUS, EXPORT_TENANT, DELIVERY_KEY, EXPORT_ATTEMPTS, EXPORT_CONFIRMED_BY)


def search_attribute_kinds() -> dict[str, str]:
    """{name: kind} as `temporal operator search-attribute create` and the dev server's flag spell them."""
    return {key.name: key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_").title()
            for key in SEARCH_ATTRIBUTES}

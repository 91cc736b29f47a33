"""How the outside world addresses an export's workflow: the client package's (exports_client/identity.py), and
the task queue of its claims, which only workers know. The dispatcher and the local stack import only this (no
activities, no store)."""

from __future__ import annotations

from exports_client.identity import (
    DELIVERY_KEY as DELIVERY_KEY,
)
from exports_client.identity import (
    EXPORT_ATTEMPTS as EXPORT_ATTEMPTS,
)
from exports_client.identity import (
    EXPORT_CONFIRMED_BY as EXPORT_CONFIRMED_BY,
)
from exports_client.identity import (
    EXPORT_STATUS as EXPORT_STATUS,
)
from exports_client.identity import (
    EXPORT_TENANT as EXPORT_TENANT,
)
from exports_client.identity import (
    EXPORT_WORKFLOW_PREFIX as EXPORT_WORKFLOW_PREFIX,
)
from exports_client.identity import (
    SEARCH_ATTRIBUTES as SEARCH_ATTRIBUTES,
)
from exports_client.identity import (
    export_workflow_id as export_workflow_id,
)
from exports_client.identity import (
    job_id_of as job_id_of,
)
from exports_client.identity import (
    search_attribute_kinds as search_attribute_kinds,
)
from exports_client.identity import (
    tenant_priority as tenant_priority,
)


def admission_queue(task_queue: str) -> str:
    """The task queue of the claims (cutoff 1) of exports whose runs are on `task_queue`: a worker polls it only
    while it has a build slot free (activities/capacity.py)."""
    return f"{task_queue}-admission"

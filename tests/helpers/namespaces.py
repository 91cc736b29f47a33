"""Temporal dev servers of a test's own, whose namespace has only the search attributes the test names: a
namespace as an earlier release left it, or one that lacks what this release needs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from starter import preflight
from starter.localstack.temporal import temporal_binary
from store.settings import Settings


@asynccontextmanager
async def namespace_with(kinds: dict[str, str]) -> AsyncIterator[WorkflowEnvironment]:
    """A dev server whose namespace has only these search attributes ({name: kind}), shut down on the way out."""
    args = [arg for name, kind in kinds.items() for arg in ("--search-attribute", f"{name}={kind}")]
    env = await asyncio.wait_for(WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter, dev_server_existing_path=temporal_binary(),
        dev_server_extra_args=args, dev_server_log_level="error"), 60)
    try:
        yield env
    finally:
        await asyncio.wait_for(env.shutdown(), 30)


def all_but(name: str, **changed: str) -> dict[str, str]:
    """This release's search attributes without `name`, with kinds changed as given."""
    return {k: changed.get(k, v) for k, v in preflight.expected_search_attributes().items() if k != name}


def worker_settings(db, env: WorkflowEnvironment, tmp_path: Path, **overrides: object) -> Settings:
    """A worker's settings on the test's database and that server, on a task queue of its own."""
    return db.settings(temporal_address=env.client.service_client.config.target_host,
                       task_queue=f"up4-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work", **overrides)

"""A Temporal dev server of a test's own, with server limits lowered so that the test reaches them in seconds, and
the flood that spends a run's signal quota."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from starter.localstack.ports import free_port
from starter.localstack.temporal import LocalTemporal


@asynccontextmanager
async def own_server(tmp_path: Path, dynamic_config: dict[str, object]) -> AsyncIterator[Client]:
    """A client to a dev server started with `dynamic_config`; the server is stopped afterwards."""
    temporal = LocalTemporal(tmp_path / "temporal", ui_port=free_port(), dynamic_config=dynamic_config)
    await temporal.start()
    try:
        yield await Client.connect(temporal.address, data_converter=pydantic_data_converter)
    finally:
        await temporal.stop()


async def spend_signal_quota(handle: WorkflowHandle[Any, Any], most: int) -> RPCError:
    """Malformed cancels to the run until the server refuses its signals (at most `most`): the refusal."""
    for n in range(most):
        try:
            await handle.signal("cancel", {"request_id": f"junk {n}"})
        except RPCError as err:
            return err
    raise AssertionError(f"the server took {most} signals to one run: its signal cap was not reached")

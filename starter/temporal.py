"""Connecting to Temporal the way every part of this project does: with the pydantic data converter."""

from __future__ import annotations

import asyncio
import re

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from store.settings import Settings

# How long a command waits for PostgreSQL or Temporal to answer a connection before it says it cannot reach it.
CONNECT_TIMEOUT_SECONDS = 5.0

# Set when a connection attempt was given up at the timeout. The SDK's attempt goes on in its own runtime (it waits
# up to 30 s for a silent server), and dropping that runtime at interpreter exit can block the exit for minutes:
# the command line then ends its process at once (`starter.cli.main`), with nothing else in flight.
abandoned_connection = False


class Unreachable(Exception):
    """PostgreSQL or Temporal could not be reached: not configured, a malformed address, refused, or silent for
    CONNECT_TIMEOUT_SECONDS. Raised before anything was sent to it."""

    def __init__(self, component: str, setting: str, where: str, reason: str) -> None:
        self.component, self.setting, self.where, self.reason = component, setting, where, reason
        at = f" at {where}" if where else ""
        super().__init__(f"{component}{at} ({setting}): {reason}")


async def connect_temporal(settings: Settings, *, timeout: float | None = None) -> Client:
    """The client. With a timeout (the command line), a connection that fails or is not answered within it is
    `Unreachable`; without one (the worker), the SDK's own errors and retries stand."""
    connecting = Client.connect(
        settings.temporal_address, namespace=settings.temporal_namespace, data_converter=pydantic_data_converter
    )
    if timeout is None:
        return await connecting

    def unreachable(reason: str) -> Unreachable:
        return Unreachable("Temporal", "EXPORTS_TEMPORAL_ADDRESS", settings.temporal_address, reason)

    if not settings.temporal_address.strip():
        connecting.close()
        raise unreachable("no address configured")
    global abandoned_connection
    try:
        return await asyncio.wait_for(connecting, timeout)
    except TimeoutError:
        abandoned_connection = True
        raise unreachable(f"no answer within {timeout:g} s") from None
    except (RuntimeError, ValueError, RPCError) as exc:  # the SDK's connection errors, a malformed address
        raise unreachable(short_reason(exc)) from None


def short_reason(exc: BaseException) -> str:
    """The gist of a connection error: the innermost message of the SDK's nested transport error, if any."""
    text = str(exc) or type(exc).__name__
    messages = re.findall(r'message: "([^"]*)"', text)
    return messages[-1].lower() if messages else text.splitlines()[0]


def workflow_id(job_id: object) -> str:
    return f"export-{job_id}"

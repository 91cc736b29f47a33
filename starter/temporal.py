"""Connecting to Temporal the way every part of this project does: with the pydantic data converter."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from store.settings import Settings


async def connect_temporal(settings: Settings) -> Client:
    return await Client.connect(
        settings.temporal_address, namespace=settings.temporal_namespace, data_converter=pydantic_data_converter
    )


def workflow_id(job_id: object) -> str:
    return f"export-{job_id}"

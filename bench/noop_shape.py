"""What P1's no-op workflows are told: the export's shape, and the queue of their own. Apart from the workflows'
module (bench/noop_worker.py), which the sandbox imports afresh for every run, as it does the export's."""

from __future__ import annotations

from pydantic import BaseModel


class Shape(BaseModel):
    on_workflow_queue: int
    on_own_queue: int
    search_attribute_updates: int  # workflow tasks that update one


def own_queue(task_queue: str) -> str:
    return f"{task_queue}-own"

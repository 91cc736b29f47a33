"""What a run costs the worker before its first command: Temporal's sandbox imports the workflow's modules afresh
for every run it starts, so a run never sees another's module state. Without bytecode to read (a source checkout
run with PYTHONDONTWRITEBYTECODE set) each import compiled the modules again: about a quarter of the worker's CPU
per export in P1 (`make bench`)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
from collections import Counter
from pathlib import Path

from tests.helpers.harness import Harness

WORKFLOWS_DIR = Path(__file__).resolve().parents[2] / "workflows"


async def test_worker__compiles_each_workflow_module_once_not_once_per_run(harness: Harness, monkeypatch,
                                                                            tmp_path):
    # No bytecode to read or to write: what the worker meets in a source checkout with PYTHONDONTWRITEBYTECODE.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "no-bytecode-here"))
    compiled: Counter[str] = Counter()
    source_to_code = importlib.machinery.SourceFileLoader.source_to_code

    def counting(self, data, path, *args, **kwargs):
        if Path(path).parent == WORKFLOWS_DIR:
            compiled[Path(path).name] += 1
        return source_to_code(self, data, path, *args, **kwargs)

    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "source_to_code", counting)

    jobs = [await harness.create() for _ in range(3)]
    rows = await asyncio.gather(*(harness.settled(job) for job in jobs))
    assert all(row.status.value == "Completed" for row in rows), rows
    # Each run was a new sandbox (three runs), and no module of theirs was compiled for more than one of them.
    assert compiled["export.py"] <= 1, compiled
    assert max(compiled.values(), default=0) <= 1, compiled

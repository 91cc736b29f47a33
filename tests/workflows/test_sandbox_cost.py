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
    executed: Counter[str] = Counter()
    source_to_code = importlib.machinery.SourceFileLoader.source_to_code
    exec_module = importlib.machinery.SourceFileLoader.exec_module

    def counting_compiles(self, data, path, *args, **kwargs):
        if Path(path).parent == WORKFLOWS_DIR:
            compiled[Path(path).name] += 1
        return source_to_code(self, data, path, *args, **kwargs)

    def counting_imports(self, module):
        if Path(module.__spec__.origin or "").parent == WORKFLOWS_DIR:
            executed[Path(module.__spec__.origin).name] += 1
        return exec_module(self, module)

    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "source_to_code", counting_compiles)
    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "exec_module", counting_imports)

    jobs = [await harness.create() for _ in range(3)]
    rows = await asyncio.gather(*(harness.settled(job) for job in jobs))
    assert all(row.status.value == "Completed" for row in rows), rows
    # Each run imported the workflow's module afresh, in a sandbox of its own; none compiled it for itself.
    assert executed["export.py"] >= 3, executed
    assert max(compiled.values(), default=0) <= 1, compiled

"""Workflow modules compiled once per worker process, not once per run.

Temporal's sandbox imports a workflow's modules afresh for each run a worker starts, so that no run sees another's
module state. Python reads each module's bytecode from `__pycache__` when it is there; where it is not (a source
checkout run with PYTHONDONTWRITEBYTECODE set, or a read-only tree) every run compiled the modules again: about a
quarter of the worker's CPU per small export (P1 in `make bench`).

Here a module's code object, compiled once, is kept and handed to each later import of the same file, unchanged on
disk. A code object is immutable: each run still executes its modules afresh and has its own module state.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Iterable, Sequence
from types import CodeType, ModuleType


class _CompiledOnceLoader(importlib.machinery.SourceFileLoader):
    # By file, its modification time and size: a file changed on disk is compiled again.
    codes: dict[tuple[str, int, int], CodeType] = {}

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        stat = os.stat(path)
        key = (path, stat.st_mtime_ns, stat.st_size)
        code = self.codes.get(key)
        if code is None:
            code = super().get_code(fullname)
            if code is None:  # SourceLoader's contract allows it; never for a .py file
                raise ImportError(f"no code for {fullname}", name=fullname)
            self.codes[key] = code
        return code


class _CompiledOnceFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of `packages` as Python's path finder does, and loads them with the loader above."""

    def __init__(self, packages: Iterable[str]) -> None:
        self.packages = set(packages)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return None  # not a plain source file: the finders after this one decide, as before
        spec.loader = _CompiledOnceLoader(spec.loader.name, spec.loader.path)
        return spec


def compile_workflow_modules_once(packages: Iterable[str]) -> None:
    """Keep the compiled code of every module of these top-level packages for the rest of the process. Calling it
    again adds packages."""
    for finder in sys.meta_path:
        if isinstance(finder, _CompiledOnceFinder):
            finder.packages.update(packages)
            return
    sys.meta_path.insert(0, _CompiledOnceFinder(packages))

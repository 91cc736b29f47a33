"""Earlier releases, run from their own code: what the upgrade tests and the release recorder start.

CHANGELOG.md lists the releases, newest first. Each is a commit of this repository: the `Commit:` line of its
entry, else the tag `v<version>`, else the newest commit whose pyproject.toml carries that version (a clone without
tags still finds it). Its code is checked out as a git worktree and run with this checkout's virtualenv: every
command runs with the worktree as its working directory, so the release's own modules come first on the path,
before the editable install of this checkout. That holds while a release's dependencies are a subset of today's,
which `release_code` checks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from starter.localstack import processes
from store.settings import Settings
from tests.helpers.support import Ran, process_env, run_command

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
_ENTRY = re.compile(r"^## (?P<version>\d+\.\d+\.\d+)\b(?P<body>.*?)(?=^## |\Z)", re.M | re.S)
_COMMIT = re.compile(r"^Commit: `?(?P<commit>[0-9a-f]{7,40})`?", re.M)


@dataclass(frozen=True)
class Release:
    version: str
    commit: str  # the full hash


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def version_of(pyproject: str) -> str:
    return tomllib.loads(pyproject)["project"]["version"]


def current_version() -> str:
    return version_of((ROOT / "pyproject.toml").read_text())


def release_commit(version: str, named: str | None) -> str:
    for ref in ([named] if named else []) + [f"v{version}"]:
        try:
            return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        except subprocess.CalledProcessError:
            if ref == named:
                raise LookupError(f"release {version}: commit {named} is not in this clone (a shallow clone? "
                                  "`git fetch --unshallow`)") from None
    # No tag: the newest commit of this history whose pyproject.toml names the version.
    for commit in _git("log", "--format=%H", "--", "pyproject.toml").splitlines():
        if version_of(_git("show", f"{commit}:pyproject.toml")) == version:
            newer = _git("log", "--format=%H", f"{commit}..HEAD", "--", "pyproject.toml").splitlines()
            # The release is the last commit before the version moved on (or HEAD, if it never did).
            return _git("rev-parse", f"{newer[-1]}^") if newer else _git("rev-parse", "HEAD")
    raise LookupError(f"release {version}: no commit of this history carries it (a shallow clone? "
                      "`git fetch --unshallow`)")


def changelog_entries() -> list[tuple[str, str | None]]:
    """(version, the commit its `Commit:` line names, if any) of every CHANGELOG.md entry, newest first."""
    return [(entry["version"], (named := _COMMIT.search(entry["body"])) and named["commit"])
            for entry in _ENTRY.finditer(CHANGELOG.read_text())]


def is_released(version: str) -> bool:
    """Whether CHANGELOG.md dates the version's entry (an entry headed `(unreleased)` is still being made)."""
    for entry in _ENTRY.finditer(CHANGELOG.read_text()):
        if entry["version"] == version:
            return "(unreleased)" not in entry.group(0).splitlines()[0]
    return False


def rollback_declared_unsupported(previous: Release) -> bool:
    """Whether this version's CHANGELOG.md entry says that rolling back to `previous` is not supported (and how to
    drain first): a `### Rolling back to <previous>` heading whose text begins `Not supported`."""
    current = current_version()
    for entry in _ENTRY.finditer(CHANGELOG.read_text()):
        if entry["version"] == current:
            found = re.search(rf"^### Rolling back to {re.escape(previous.version)}\s*\n+(\S.*)$", entry.group(0), re.M)
            return found is not None and found.group(1).startswith("Not supported")
    return False


def rollback_removes_schedules(previous: Release) -> list[str]:
    """The schedules this version's CHANGELOG.md entry says to remove before rolling back to `previous` (their
    workflow is new in this version): each `exports schedules remove <id> ...` in its `### Rolling back to` text."""
    current = current_version()
    for entry in _ENTRY.finditer(CHANGELOG.read_text()):
        if entry["version"] == current:
            found = re.search(rf"^### Rolling back to {re.escape(previous.version)}\s*\n(.*?)(?=^###|\Z)",
                              entry.group(0), re.M | re.S)
            if found is None:
                return []
            return [i for command in re.findall(r"`exports schedules remove ([^`]+)`", found.group(1))
                    for i in command.split()]
    return []


def previous_release() -> Release:
    """The newest release before the code of this checkout."""
    current = current_version()
    for version, named in changelog_entries():
        if version != current:
            return Release(version, release_commit(version, named))
    raise LookupError("CHANGELOG.md names no release before this one")


# Run first in every process of a release: this checkout's editable install resolves a package's submodules by name
# (a module the release lacks would come from here, silently), so only the release's tree and the site packages
# may answer an import.
_OWN_CODE_ONLY = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in "
                  "getattr(f, '__name__', type(f).__name__)]; ")


_REPLAY = """
import asyncio, importlib, inspect, json, os, pkgutil, sys
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
import workflows
classes = []
for info in pkgutil.iter_modules(workflows.__path__):
    module = importlib.import_module("workflows." + info.name)
    classes += [c for _, c in inspect.getmembers(module, inspect.isclass)
                if c.__module__ == module.__name__ and hasattr(c, "__temporal_workflow_definition")]
async def main():
    failures = []
    for path in sys.argv[1:]:
        data = json.load(open(path))
        started = data["events"][0]["workflowExecutionStartedEventAttributes"]
        replayer = Replayer(workflows=classes, data_converter=pydantic_data_converter)
        result = await replayer.replay_workflow(WorkflowHistory.from_json(started["workflowId"], data),
                                                raise_on_replay_failure=False)
        if result.replay_failure is not None:
            failures.append(path + ": " + str(result.replay_failure).splitlines()[0][:300])
    print(json.dumps(failures), flush=True)
asyncio.run(main())
# Without the interpreter's teardown, where the SDK's threads could abort the process once the answer was printed
# (temporalio/sdk-python#300; seen once replaying 0.2.0's code: exit -6, "PyGILState_Release").
os._exit(0)
"""


@dataclass
class ReleaseCode:
    """A release's code in a worktree of its own, and how to run its commands and its worker."""

    release: Release
    tree: Path

    async def command(self, *args: str, settings: Settings, bound: float = 60) -> Ran:
        """The release's own `exports` command line (its console script would import this checkout's)."""
        ran = await run_command(sys.executable, "-c", _OWN_CODE_ONLY + "from starter.cli import main; main()", *args,
                                env=process_env(settings), cwd=self.tree, bound=bound)
        if ran.code == -6 and ran.stdout.strip():
            # 0.1.0's commands could abort in the interpreter's teardown after their answer was printed (the SDK's
            # threads at exit, temporalio/sdk-python#300; fixed in 0.2.0 by exiting without it): the answer stands.
            ran.code = 0
        return ran

    async def python(self, code: str, *, settings: Settings, bound: float = 60) -> Ran:
        return await run_command(sys.executable, "-c", _OWN_CODE_ONLY + code, env=process_env(settings), cwd=self.tree,
                                 bound=bound)

    async def replay(self, histories: list[Path], *, bound: float = 120) -> list[str]:
        """Replays histories on the release's own workflow code (every workflow class in its workflows/, the
        pydantic converter); the failures, one line each."""
        ran = await run_command(sys.executable, "-c", _OWN_CODE_ONLY + _REPLAY, *map(str, histories),
                                env=process_env(Settings(_env_file=None)), cwd=self.tree, bound=bound)
        assert ran.code == 0, ran
        return json.loads(ran.stdout.strip().splitlines()[-1])

    async def spawn_worker(self, settings: Settings, log_path: Path):
        start = _OWN_CODE_ONLY + "import runpy; runpy.run_module('worker', run_name='__main__', alter_sys=True)"
        return await processes.spawn(sys.executable, "-c", start, log_path=log_path, env=process_env(settings),
                                     cwd=str(self.tree))


def _dependencies(pyproject: str) -> set[str]:
    names = tomllib.loads(pyproject)["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", name, maxsplit=1)[0].lower() for name in names}


@contextmanager
def release_code(release: Release) -> Iterator[ReleaseCode]:
    """The release checked out in a temporary git worktree, removed on the way out."""
    released = _dependencies(_git("show", f"{release.commit}:pyproject.toml"))
    today = _dependencies((ROOT / "pyproject.toml").read_text())
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    today |= {re.split(r"[<>=!~\[; ]", n, maxsplit=1)[0].lower() for names in optional.values() for n in names}
    missing = released - today
    assert not missing, f"release {release.version} needs {sorted(missing)}, which this virtualenv lacks"
    _git("worktree", "prune")
    tree = Path(tempfile.mkdtemp(prefix=f"exports-{release.version}-")) / "tree"
    _git("worktree", "add", "--detach", str(tree), release.commit)
    try:
        yield ReleaseCode(release, tree)
    finally:
        _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree.parent, ignore_errors=True)

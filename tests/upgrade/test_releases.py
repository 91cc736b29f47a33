"""Releases (case UP6): each has a version, a commit (and a tag where the clone has tags), an entry in CHANGELOG.md
with its upgrade notes, and the histories its own code recorded."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers.releases import CHANGELOG, ROOT, changelog_entries, current_version, release_commit, version_of
from tests.replay.history_files import HISTORIES


def entry(version: str) -> str:
    found = re.search(rf"^## {re.escape(version)}\b.*?(?=^## |\Z)", CHANGELOG.read_text(), re.M | re.S)
    assert found, f"CHANGELOG.md has no entry for {version}"
    return found.group(0)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.spec("UP6")
def test_releases__this_version_has_its_upgrade_and_rollback_notes():
    versions = [version for version, _ in changelog_entries()]
    current = current_version()
    assert versions[0] == current, "the newest CHANGELOG.md entry is pyproject.toml's version"
    notes = entry(current)
    previous = versions[1]
    for heading in (f"### Upgrading from {previous}", f"### Rolling back to {previous}"):
        assert heading in notes, f"{current}'s entry lacks {heading!r}"


@pytest.mark.spec("UP6")
@pytest.mark.parametrize("version,named", [e for e in changelog_entries() if e[0] != current_version()])
def test_releases__each_earlier_release_is_a_commit_carrying_its_version_and_its_histories(version, named):
    commit = release_commit(version, named)
    assert version_of(git("show", f"{commit}:pyproject.toml")) == version
    tags = git("tag", "--list", f"v{version}")
    if tags:  # a clone may carry no tags: then the history alone names the commit
        assert git("rev-parse", f"v{version}^{{commit}}") == commit
    assert sorted((HISTORIES / version).glob("*.json")), f"no histories of {version} in {HISTORIES / version}"

"""Fixtures of the upgrade tests only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.releases import ReleaseCode, previous_release, release_code


@pytest.fixture(scope="module")
def previous() -> Iterator[ReleaseCode]:
    """The previous release's code, checked out from this repository's history for the module's tests."""
    with release_code(previous_release()) as code:
        yield code

"""Named points in an attempt where a test can hold a real activity, as a paused worker would be held.

In production every checkpoint passes at once. A test replaces `ExportActivities.checkpoints` with one whose
`reached` waits (for an event it controls) or kills the process, at exactly that point.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from uuid import UUID

log = logging.getLogger(__name__)

CLAIM = "claim"                      # before the claim statement
AFTER_CLAIM = "after_claim"          # the claim statement answered; the activity has not yet returned
BUILD_STARTED = "build_started"      # the build activity has renewed its lease and is about to build
BUILD_CANCELLED = "build_cancelled"  # the build was cancelled; the lease still kept, the stop not yet written
BEFORE_CUTOFF_2 = "before_cutoff_2"  # the file is built; cutoff 2 not yet attempted
AFTER_CUTOFF_2 = "after_cutoff_2"    # cutoff 2 committed; its step has not yet answered
BEFORE_UPLOAD = "before_upload"      # cutoff 2 committed; nothing sent yet
BEFORE_RENAME_FENCE = "before_rename_fence"  # every byte sent; the rename fence not yet tried
AFTER_RECEIPT = "after_receipt"      # the partner confirmed the file; the terminal write not yet made
BEFORE_STEP = "before:"              # + a step's name: an attempt step started, its lease keeper not yet adopted


class Checkpoints:
    async def reached(self, name: str, job_id: UUID) -> None:
        return None


class HoldingCheckpoints(Checkpoints):
    """Holds at the named points, after leaving a marker file, so that a test can SIGKILL or SIGSTOP the worker
    process exactly there; a `release-<name>-<job id>` file beside the marker lets it go on. Set only through
    EXPORTS_HOLD_AT, for fault-injection runs; empty in production."""

    def __init__(self, names: set[str], marker_dir: Path) -> None:
        self.names = names
        self.marker_dir = marker_dir

    async def reached(self, name: str, job_id: UUID) -> None:
        if name not in self.names:
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        (self.marker_dir / f"held-{name}-{job_id}").touch()
        log.warning("holding export %s at checkpoint %s (EXPORTS_HOLD_AT)", job_id, name)
        release = self.marker_dir / f"release-{name}-{job_id}"
        while not release.exists():
            await asyncio.sleep(0.1)
        log.warning("released export %s at checkpoint %s", job_id, name)


def checkpoints_for(hold_at: str, marker_dir: Path) -> Checkpoints:
    names = {name.strip() for name in hold_at.split(",") if name.strip()}
    return HoldingCheckpoints(names, marker_dir) if names else Checkpoints()

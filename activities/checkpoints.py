"""Named points in an attempt where a test can hold a real activity, as a paused worker would be held.

In production every checkpoint passes at once. A test replaces `ExportActivities.checkpoints` with one whose
`reached` waits (for an event it controls) or kills the process, at exactly that point.
"""

from __future__ import annotations

from uuid import UUID

CLAIM = "claim"                      # before the claim statement
BUILD_STARTED = "build_started"      # the build activity has renewed its lease and is about to build
BEFORE_CUTOFF_2 = "before_cutoff_2"  # the file is built; cutoff 2 not yet attempted
BEFORE_UPLOAD = "before_upload"      # cutoff 2 committed; nothing sent yet
AFTER_RECEIPT = "after_receipt"      # the partner confirmed the file; the terminal write not yet made


class Checkpoints:
    async def reached(self, name: str, job_id: UUID) -> None:
        return None

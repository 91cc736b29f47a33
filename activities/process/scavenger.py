"""The scavenger: built files are contact data, so any a worker left behind (it died between the build and the
delivery, a removal failed, a fenced build's, a handed-over lease nobody adopted) are removed once their attempt
can no longer use them. Run when a worker starts and then every `scavenge_interval_seconds` while it runs."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from pathlib import Path

from activities.builder import remove_local_file
from store.jobs import JobStore
from store.models import Status

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.scavenger")

# <job>-<attempt>-<build token>.csv (and .csv.partial while it is written); the token is the last part of the
# build's holder (claimed_by).
_BUILT = re.compile(
    r"^(?P<job>[0-9a-f-]{36})-(?P<attempt>[0-9a-f-]{36})(?:-(?P<token>[0-9a-z.]+))?\.csv(?:\.partial)?$")


async def scavenge(store: JobStore, work_dir: Path) -> list[Path]:
    """Remove built files whose build no longer holds its attempt's row in Running or Delivering (the attempt
    ended, was taken over, or another build of it fenced this one); the removed paths."""
    removed: list[Path] = []
    if not work_dir.is_dir():
        return removed
    for path in sorted(work_dir.iterdir()):
        match = _BUILT.match(path.name)
        if match is None:
            continue
        row = await store.read_job(uuid.UUID(match["job"]))
        still_needed = (row is not None and row.attempt_id == uuid.UUID(match["attempt"])
                        and row.status in (Status.RUNNING, Status.DELIVERING)
                        and (match["token"] is None or (row.claimed_by or "").endswith(f"/{match['token']}")))
        if not still_needed and remove_local_file(path):
            log.info("scavenged %s: its attempt can no longer deliver it", path.name)
            removed.append(path)
    return removed


async def keep_scavenging(store: JobStore, work_dir: Path, every: float) -> None:
    """Scavenge every `every` seconds (the worker scavenged once as it started), until cancelled. A failed pass
    (the database is away) is logged and tried again at the next."""
    while True:
        await asyncio.sleep(every)
        try:
            await scavenge(store, work_dir)
        except Exception as exc:
            log.warning("scavenging %s failed, trying again in %.0f s: %s", work_dir, every, exc)

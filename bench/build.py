"""P5: the CSV build of a tenant's contacts (the builder: COPY, sha256, the local file), against `psql \\copy` of the
same query to a file in the same run, MB/s; and how much the builder adds to the process's peak RSS.

The build runs in a child process of its own, so that its peak RSS is the build's and nothing else's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import asyncpg

from activities.builder import contacts_query
from bench.stack import postgres_only
from bench.table import Row, middle
from starter.localstack.postgres import ROLES
from starter.localstack.seed import seed_contacts
from store.db import asyncpg_dsn

# Run as `python -c CHILD dsn tenant path`: builds once and prints its size, seconds and RSS growth as JSON.
CHILD = """
import asyncio, json, resource, sys, time, uuid
from pathlib import Path
from activities.builder import build_contacts_csv, copy_connections

async def main():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    connections = copy_connections(sys.argv[1], most=1)
    size, _ = await build_contacts_csv(connections, uuid.UUID(sys.argv[2]), Path(sys.argv[3]))
    seconds = time.perf_counter() - started
    await connections.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"bytes": size, "seconds": seconds, "rss_kib": peak - before, "peak_kib": peak}))

asyncio.run(main())
"""


async def _run(*argv: str) -> str:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE,
                                                   cwd=str(Path(__file__).resolve().parents[1]))
    out, err = await asyncio.wait_for(process.communicate(), timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed: {err.decode(errors='replace').strip()[-500:]}")
    return out.decode()


async def measure(*, contacts: int, rounds: int) -> Row:
    async with postgres_only("build") as (folder, postgres):
        owner = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant = uuid.uuid4()
        await seed_contacts(owner, tenant, contacts)
        await owner.execute("VACUUM ANALYZE contacts")
        await owner.close()
        query = contacts_query(tenant)
        ours, theirs, rss = [], [], []
        for _ in range(rounds):
            target = folder / "psql.csv"
            started = time.perf_counter()
            await _run(str(postgres.program("psql")), "-X", "-q", "-h", postgres.socket_dir, "-U", ROLES["app"],
                       "-d", "postgres", "-c", f"\\copy ({query}) to '{target}' with (format csv, header)")
            theirs.append(target.stat().st_size / 1e6 / (time.perf_counter() - started))
            built = json.loads(await _run(sys.executable, "-c", CHILD, asyncpg_dsn(postgres.url("app")), str(tenant),
                                          str(folder / "built.csv")))
            # The same bytes as psql's, so the two rates compare like for like.
            if built["bytes"] != target.stat().st_size:
                raise RuntimeError(f"the builder wrote {built['bytes']} bytes, psql {target.stat().st_size}")
            ours.append(built["bytes"] / 1e6 / built["seconds"])
            rss.append((built["rss_kib"] / 1024, built["peak_kib"] / 1024))
    row = Row("P5", f"CSV build of {contacts:,} contacts", "MB/s", middle(ours),
              middle(theirs), "psql \\copy (query) to file", ">= 1.0")
    grown, peak = middle(rss)
    row.notes.append(f"the build grew the process's peak RSS by {grown:.1f} MiB, to {peak:.0f} MiB (goal: at most "
                     "50 MB growth)")
    return row

"""The builder's throughput, as a ratio against a baseline measured in the same run.

The baseline is the same COPY of the same contacts into a sink that discards the bytes; the ratio says what
hashing and writing the local file while streaming cost on top of PostgreSQL's COPY itself.

    .venv/bin/python bench/build_throughput.py [--contacts 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from activities.builder import CONTACTS_QUERY, build_contacts_csv
from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_contacts
from store.db import asyncpg_dsn, migrate


async def baseline(dsn: str, tenant_id: uuid.UUID) -> int:
    size = 0

    async def discard(chunk: bytes) -> None:
        nonlocal size
        size += len(chunk)

    conn = await asyncpg.connect(dsn)
    try:
        await conn.copy_from_query(CONTACTS_QUERY, tenant_id, output=discard, format="csv", header=True)
    finally:
        await conn.close()
    return size


async def main(contacts: int, rounds: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="exports-bench-"))
    postgres = LocalPostgres(folder / "data")
    postgres.start()
    try:
        await migrate(postgres.url("owner"))
        owner = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant_id = uuid.uuid4()
        await seed_contacts(owner, tenant_id, contacts)
        await owner.close()
        dsn = asyncpg_dsn(postgres.url("app"))
        copy_times, build_times = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            size = await baseline(dsn, tenant_id)
            copy_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            built, _ = await build_contacts_csv(dsn, tenant_id, folder / "built.csv")
            build_times.append(time.perf_counter() - started)
            assert built == size
        copy, build = statistics.median(copy_times), statistics.median(build_times)
        print(f"baseline: COPY to a discarding sink {size / copy / 1e6:8.1f} MB/s")
        print(f"builder: COPY, sha256, file      {size / build / 1e6:8.1f} MB/s")
        print(f"the builder takes {build / copy:.2f}x the baseline ({contacts} contacts, {size / 1e6:.1f} MB, "
              f"median of {rounds})")
    finally:
        postgres.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contacts", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.contacts, args.rounds))

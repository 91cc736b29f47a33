"""P6: a delivery of a large file to OpenSSH's sshd on loopback, against OpenSSH's own `sftp` client doing the same
in the same run (put to the temporary name, then rename), MB/s.

The project's side is the whole delivery as a worker runs it (connect with the pinned host key, baseline listing,
upload to the temporary name, no-overwrite rename, receipt listing); the destination's contract asks for no
evidence by content, so nothing is read back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from pathlib import Path

from activities.partner_delivery import deliver
from bench.stack import bench_folder
from bench.table import Row, middle
from tests.helpers.openssh_partner import SSHD, OpenSshPartner

MB = 1_000_000


async def _openssh_put(server: OpenSshPartner, local: Path, name: str) -> None:
    dest = server.destination()
    known = server.folder / "known_hosts"
    known.write_text(f"[127.0.0.1]:{server.port} {server.host_key_line}\n")
    batch = server.folder / f"{name}.batch"
    batch.write_text(f"put {local} {dest.temp_dir}/.{name}.part\nrename {dest.temp_dir}/.{name}.part "
                     f"{dest.final_dir}/{name}\n")
    process = await asyncio.create_subprocess_exec(
        "sftp", "-q", "-b", str(batch), "-P", str(server.port), "-i", str(server.client_key_path),
        "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
        f"{dest.username}@127.0.0.1", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(process.communicate(), timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"sftp failed: {err.decode(errors='replace').strip()}")


async def _deliver(server: OpenSshPartner, local: Path, name: str) -> None:
    async def record(_: dict) -> None:
        return None

    result = await deliver(server.destination(), str(local), name, f".{name}.{uuid.uuid4()}.part",
                           record_evidence=record)
    if result.outcome != "Completed":
        raise RuntimeError(f"delivery did not complete: {result.summary}")


async def measure(*, megabytes: int, rounds: int) -> Row:
    folder = bench_folder("upload")
    local = folder / "payload.csv"
    with open(local, "wb") as f:  # incompressible, like a CSV after the cipher: compression is off on both sides
        for _ in range(megabytes):
            f.write(os.urandom(MB))
    server = await OpenSshPartner(folder / "sshd").start()
    try:
        ours, theirs = [], []
        for round_ in range(rounds):
            for label, run, rates in (("openssh", _openssh_put, theirs), ("project", _deliver, ours)):
                name = f"{label}-{round_}.csv"
                started = time.perf_counter()
                await run(server, local, name)
                rates.append(megabytes / (time.perf_counter() - started))
                (server.root / "outbound" / name).unlink()
    finally:
        await server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return Row("P6", f"{megabytes} MB delivery to sshd on loopback", "MB/s", middle(ours), middle(theirs),
               "OpenSSH sftp put + rename", ">= 1.1")


def unavailable() -> str | None:
    """Why this measure cannot run here, or None."""
    if not Path(SSHD).exists() or shutil.which("sftp") is None:
        return "needs OpenSSH's sshd and sftp (Debian's openssh-server and openssh-client)"
    return None

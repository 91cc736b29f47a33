"""Child processes of the local stack and the tests: started with their output in a log file, stopped by PID."""

from __future__ import annotations

import asyncio
from pathlib import Path


async def spawn(*args: str, log_path: Path, env: dict[str, str] | None = None,
                cwd: str | None = None) -> asyncio.subprocess.Process:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:  # the child keeps its own copy of the descriptor
        return await asyncio.create_subprocess_exec(
            *args, stdout=log_file, stderr=log_file, stdin=asyncio.subprocess.DEVNULL, env=env, cwd=cwd)


async def stop(process: asyncio.subprocess.Process | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it outlives the timeout. Never raises for a process that already ended."""
    if process is None or process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout=timeout)
    except TimeoutError:
        process.kill()
        await process.wait()

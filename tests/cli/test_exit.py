"""A command that used the Temporal client ends with its own exit status, every time. The SDK's Rust threads can
call into Python while the interpreter finalizes, which aborts the process (SIGABRT, status 134) about one run in
fifteen (temporalio/sdk-python#300); the commands and the worker end without that teardown."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.helpers.support import run_command

RUNS = 40


async def test_a_command_that_used_temporal_exits_with_its_own_status_every_time(tmp_path):
    closed = "127.0.0.1:1"  # nothing listens on port 1: refused at once
    env = {**os.environ, "EXPORTS_TEMPORAL_ADDRESS": closed}
    env.pop("TEMPORAL_ADDRESS", None)
    exports = str(Path(sys.executable).parent / "exports")
    codes = []
    for _ in range(RUNS // 4):
        ran = await asyncio.gather(*(run_command(exports, "schedules", "install", env=env, cwd=tmp_path, bound=60)
                                     for _ in range(4)))
        codes += [r.code for r in ran]
        for r in ran:
            assert "unreachable: Temporal at 127.0.0.1:1" in r.stderr, r
    assert codes == [5] * RUNS, f"exit statuses: {sorted(set(codes))}, aborted {codes.count(-6) + codes.count(134)}"

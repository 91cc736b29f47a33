"""A real TCP proxy that cuts connections: the first `cut_first` connections it accepts end before a byte reaches
the server, by a close (the client reads the end of the stream) or a reset (an RST); later ones pass through byte
for byte. So a client sees what a server dropping excess connections (OpenSSH's MaxStartups) or a flaky link shows
it. `events` records, in the order of acceptance, what became of each connection. `go_silent` stops it forwarding
either way without closing anything (a network that drops packets) until `heal`; `go_down` resets every connection
and every new one until then, as a server that stopped does (its host answers with a reset)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Coroutine
from typing import Any, Literal

log = logging.getLogger(__name__)

Cut = Literal["close", "reset"]
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST instead of a FIN


class TcpCutProxy:
    """127.0.0.1:<port> -> host:port. Cuts the first `cut_first` connections (`how`), forwards the rest."""

    def __init__(self, host: str, port: int, *, cut_first: int = 0, how: Cut = "close") -> None:
        self.upstream = (host, port)
        self.cut_first = cut_first
        self.how = how
        self.port = 0
        self.events: list[str] = []  # "cut" or "passed", one per accepted connection, in order
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()  # cleared while silent
        self._flowing.set()
        self._down = False

    @property
    def accepted(self) -> int:
        return len(self.events)

    @property
    def cut(self) -> int:
        return self.events.count("cut")

    @property
    def passed(self) -> int:
        return self.events.count("passed")

    async def start(self) -> TcpCutProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def go_silent(self) -> None:
        """Nothing is forwarded either way, on open connections or new ones (accepted, never answered), and nothing
        is closed, until heal()."""
        self._flowing.clear()

    def go_down(self) -> None:
        """Every open connection is reset, and every new one, until heal()."""
        self._down = True
        for writer in list(self._writers):
            writer.transport.abort()

    def heal(self) -> None:
        """What was held is forwarded, as TCP retransmits it, and forwarding goes on; connections are taken again."""
        self._down = False
        self._flowing.set()

    async def stop(self) -> None:
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> TcpCutProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._flowing.wait()
        if self._down:
            self.events.append("refused")
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            writer.transport.abort()
            return
        if self.accepted < self.cut_first:
            self.events.append("cut")
            log.info("proxy: cutting connection %d (%s)", self.accepted, self.how)
            await self._cut(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as exc:
            log.warning("proxy cannot reach %s:%d: %s", *self.upstream, exc)
            writer.transport.abort()
            self.events.append("unreachable")
            return
        self.events.append("passed")
        self._writers.update((writer, up_writer))
        self._spawn(self._pump(reader, up_writer, writer))
        self._spawn(self._pump(up_reader, writer, up_writer))

    async def _cut(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            writer.transport.abort()
            return
        # A FIN first, then whatever the client still sends is read, so the kernel has no unread data that would
        # turn the close into a reset.
        writer.write_eof()
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(10):
                await reader.read()
        writer.close()

    async def _pump(self, reader: asyncio.StreamReader, to: asyncio.StreamWriter,
                    other: asyncio.StreamWriter) -> None:
        """One direction; when it ends, both sides close (SSH does not half-close), after what was written to
        them goes out: a server's last words (a disconnect message) reach the client."""
        try:
            while data := await reader.read(64 * 1024):
                await self._flowing.wait()
                to.write(data)
                await to.drain()
        except OSError:
            pass
        finally:
            for writer in (to, other):
                writer.close()
                self._writers.discard(writer)


def temporal_upstream(client: Any) -> tuple[str, int]:
    """Where a Temporal client connects: the upstream of a proxy put in a worker's way to the server."""
    host, port = client.service_client.config.target_host.rsplit(":", 1)
    return host, int(port)

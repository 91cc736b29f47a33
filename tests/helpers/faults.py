"""A real fault injector: a TCP proxy in front of PostgreSQL (its Unix socket, or its TCP port) that cuts
connections at chosen points of the v3 wire protocol, so a test can lose a response after the server has
committed, or lose a statement before it reaches the server, exactly as a dropped network connection would. It can
also go silent (`go_silent`): a partition that drops packets, where nothing is forwarded either way and neither
side is closed or told, until `heal`.

A userspace proxy acknowledges what the client sends, so the client's kernel sees a live peer: the silence tests
the client's own bounds (its statement and connect timeouts), not TCP keepalives or TCP_USER_TIMEOUT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

# Untyped requests a client may send before its startup packet; the proxy answers them itself ("not supported"),
# so the server only ever sees the plain startup packet and its replies are typed messages from the first byte.
# The claim statement (store/sql/claim.sql), as a cut finds it on the wire.
CLAIM_STATEMENT = "WITH claimed AS"
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


def socket_path(socket_dir: str) -> str:
    """The server's socket file in `socket_dir` (its name carries the port)."""
    found = sorted(Path(socket_dir).glob(".s.PGSQL.*"))
    found = [p for p in found if not p.name.endswith(".lock")]
    if len(found) != 1:
        raise RuntimeError(f"expected one PostgreSQL socket in {socket_dir}, found {found}")
    return str(found[0])


def upstream_of(server: Any) -> str:
    """Where the proxy forwards to: the server's Unix socket when it has one in reach, else its TCP host:port
    (a server in a container, or one given by a TCP URL)."""
    if server.socket_dir:
        return socket_path(server.socket_dir)
    url = make_url(server.url("owner"))
    return f"{url.host or '127.0.0.1'}:{url.port or 5432}"


class _Dead(Exception):
    """A connection that a healed partition left behind: it forwards nothing, ever again."""


@dataclass
class _Rule:
    marker: bytes
    fired: asyncio.Event = field(default_factory=asyncio.Event)
    failed: bool = False  # the armed statement failed: nothing will commit
    silence: bool = False  # at the commit, go silent instead of cutting


@dataclass(eq=False)  # identity: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    prepared: dict[bytes, bytes] = field(default_factory=dict)  # statement name -> its SQL
    armed: _Rule | None = None  # a cut_after_commit rule waiting for this connection's COMMIT
    dead: bool = False  # silent for good: a partition healed without it (see PgFaultProxy.heal)

    def close(self) -> None:
        for writer in (self.client, self.server):
            with contextlib.suppress(Exception):
                writer.transport.abort()  # abort, not close: nothing buffered gets out after the cut


class PgFaultProxy:
    """127.0.0.1:<port> -> the server (a Unix socket's path, or host:port). Each rule fires once; `log_messages`
    shows what clients send."""

    def __init__(self, upstream: str, *, log_messages: bool = False) -> None:
        self.upstream = upstream
        self.log_messages = log_messages
        self.port = 0
        self.accepted = 0  # connections forwarded to the server
        self.refused = 0  # connections closed at once while refusing
        self.held = 0  # connections waiting, right now, for accept_new_connections()
        self._mode = "open"  # "open", "refuse" or "hold"
        self._released = asyncio.Event()
        self._flowing = asyncio.Event()  # cleared while silent: nothing is forwarded either way
        self._flowing.set()
        self._silenced: set[_Conn] = set()  # the connections open when the silence began
        self.sent: list[tuple[str, str]] = []  # (type, text) of client messages, when log_messages
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._after_commit: _Rule | None = None
        self._before: _Rule | None = None

    async def start(self) -> PgFaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._mode = "refuse"  # held connections, released below, are closed rather than forwarded
        self._released.set()
        self._flowing.set()
        self.cut_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def url(self, role: str, database: str) -> str:
        return f"postgresql+asyncpg://{role}@127.0.0.1:{self.port}/{database}"

    # --- faults -------------------------------------------------------------------------------------------------

    def cut_after_commit(self, marker: str) -> asyncio.Event:
        """Let the statement holding `marker` and its commit through, then drop the server's reply to the commit
        and close both sides: committed on the server, never heard by the client. The commit is a COMMIT, or, for
        a statement run outside a transaction block, the statement itself (the server is idle after it). The
        event is set at the cut."""
        self._after_commit = _Rule(marker.encode())
        return self._after_commit.fired

    def silent_after_commit(self, marker: str) -> asyncio.Event:
        """As cut_after_commit, but instead of the cut the proxy goes silent (go_silent), holding the reply to the
        commit: committed on the server, unheard by the client for as long as the partition lasts."""
        self._after_commit = _Rule(marker.encode(), silence=True)
        return self._after_commit.fired

    def cut_before(self, marker: str) -> asyncio.Event:
        """Close both sides instead of forwarding the message holding `marker`: the server never sees it."""
        self._before = _Rule(marker.encode())
        return self._before.fired

    def refuse_new_connections(self) -> None:
        """New connections are accepted and closed at once, before any byte reaches the server."""
        self._mode = "refuse"

    def hold_new_connections(self) -> None:
        """New connections are accepted and left waiting, unanswered, until accept_new_connections()."""
        self._mode = "hold"
        self._released.clear()

    def accept_new_connections(self) -> None:
        self._mode = "open"
        self._released.set()

    def go_silent(self) -> None:
        """A silent partition: from now on no byte is forwarded in either direction, on open connections and on
        new ones (accepted, never answered), and no socket is closed, until heal()."""
        self._flowing.clear()
        self._silenced = set(self._conns)

    def heal(self, *, keep_open_connections: bool = True) -> None:
        """The partition ends: what was held is forwarded, as TCP retransmits it. With keep_open_connections=False
        the connections open when it began never come back (a NAT table flushed, an address moved): the server's
        side is closed, as the server would end it, and the client's stays open and silent until the client gives
        up on it; only connections made since then work."""
        if not keep_open_connections:
            for conn in self._silenced & self._conns:
                conn.dead = True
                with contextlib.suppress(Exception):
                    conn.server.transport.abort()
        self._silenced = set()
        self._flowing.set()

    @property
    def silent(self) -> bool:
        return not self._flowing.is_set()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def cut_all(self) -> None:
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()

    # --- plumbing -----------------------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._mode == "hold":
            self.held += 1
            try:
                await self._released.wait()
            finally:
                self.held -= 1
        await self._flowing.wait()  # silent: accepted, never answered
        if self._mode == "refuse":
            self.refused += 1
            client_w.transport.abort()
            return
        try:
            server_r, server_w = await self._open_upstream()
        except OSError as exc:
            log.warning("proxy cannot reach %s: %s", self.upstream, exc)
            client_w.transport.abort()
            return
        self.accepted += 1
        conn = _Conn(client_w, server_w)
        self._conns.add(conn)
        self._spawn(self._pump_client(conn, client_r))
        self._spawn(self._pump_server(conn, server_r))

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.upstream.startswith("/"):
            return await asyncio.open_unix_connection(self.upstream)
        host, port = self.upstream.rsplit(":", 1)
        return await asyncio.open_connection(host, int(port))

    async def _pump_client(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            # Untyped packets (SSL/GSS requests, then the startup packet): int32 length including itself, body.
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack("!i", head)[0] - 4)
                await self._forwarding(conn)
                code = struct.unpack("!i", body[:4])[0]
                if code in (SSL_REQUEST, GSSENC_REQUEST):
                    conn.client.write(b"N")
                    continue
                conn.server.write(head + body)
                break
            # Typed messages: 1 type byte, int32 length including itself, body.
            while True:
                head = await reader.readexactly(5)
                body = await reader.readexactly(struct.unpack("!i", head[1:])[0] - 4)
                await self._forwarding(conn)
                if not self._on_client_message(conn, head[:1], body):
                    return
                conn.server.write(head + body)
                await conn.server.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except _Dead:
            # Read and drop whatever the client still sends, until it gives up on the connection.
            with contextlib.suppress(ConnectionError, OSError):
                while await reader.read(64 * 1024):
                    pass
        finally:
            self._drop(conn)

    async def _forwarding(self, conn: _Conn) -> None:
        """Returns once this connection may forward again (at once unless silent); _Dead when it never will."""
        await self._flowing.wait()
        if conn.dead:
            raise _Dead

    def _on_client_message(self, conn: _Conn, kind: bytes, body: bytes) -> bool:
        """Whether to forward the message; arms or fires the rules on the SQL it carries."""
        if kind == b"Q":
            sql = body.rstrip(b"\0")
        elif kind == b"P":
            name, _, rest = body.partition(b"\0")
            sql = rest.partition(b"\0")[0]
            conn.prepared[name] = sql  # asyncpg caches statements and later runs them by name alone
        elif kind == b"B":
            sql = conn.prepared.get(body.split(b"\0", 2)[1], b"")  # portal name, then the statement's name
        else:
            return True
        if self.log_messages:
            self.sent.append((kind.decode(), sql.decode(errors="replace")))
        if self._before is not None and self._before.marker in sql:
            log.info("proxy: cutting before %r", self._before.marker)
            self._before.fired.set()
            self._before = None
            self._drop(conn)
            return False
        # Armed when the statement runs (Bind or a simple query), not when it is only prepared: a prepare ends in
        # its own ReadyForQuery, which must not be taken for the commit.
        if self._after_commit is not None and kind != b"P" and self._after_commit.marker in sql:
            conn.armed, self._after_commit = self._after_commit, None
        return True

    async def _pump_server(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                head = await reader.readexactly(5)
                body = await reader.readexactly(struct.unpack("!i", head[1:])[0] - 4)
                await self._forwarding(conn)
                # CommandComplete "COMMIT": the server has committed. Drop it and everything after it.
                if conn.armed is not None and head[:1] == b"C" and body.rstrip(b"\0") == b"COMMIT":
                    if not await self._fire(conn, "the commit"):
                        return
                if conn.armed is not None and head[:1] == b"C" and body.rstrip(b"\0") == b"ROLLBACK":
                    conn.armed = None  # the statement failed: nothing committed, nothing to cut
                if conn.armed is not None and head[:1] == b"E":
                    conn.armed.failed = True
                # ReadyForQuery "idle" right after the armed statement ran outside a transaction block: its own
                # commit. Drop it, so the client never learns the answer.
                if conn.armed is not None and head[:1] == b"Z" and body == b"I":
                    if conn.armed.failed:
                        conn.armed = None
                    elif not await self._fire(conn, "the autocommit"):
                        return
                conn.client.write(head + body)
                await conn.client.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, _Dead):
            pass
        finally:
            if not conn.dead:  # a dead connection's client side stays open until the client closes it
                self._drop(conn)

    async def _fire(self, conn: _Conn, what: str) -> bool:
        """The armed rule's commit is here: cut (False: the caller drops the reply and ends), or go silent and
        hold the reply until a heal (True: the caller forwards it then)."""
        rule = conn.armed
        assert rule is not None
        conn.armed = None
        log.info("proxy: %s after %s of %r", "silent" if rule.silence else "cutting", what, rule.marker)
        rule.fired.set()
        if not rule.silence:
            return False
        self.go_silent()
        await self._forwarding(conn)
        return True

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._conns.discard(conn)


@contextlib.asynccontextmanager
async def fault_proxy(server: Any, **kwargs: bool):  # type: ignore[no-untyped-def]
    """A proxy in front of `server` (the suite's PostgreSQL: embedded, existing or in a container)."""
    proxy = await PgFaultProxy(upstream_of(server), **kwargs).start()
    try:
        yield proxy
    finally:
        await proxy.stop()

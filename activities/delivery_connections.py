"""SSH connections that a worker's deliveries hand on to each other, one delivery at a time on each.

Each delivery used to open an SSH connection of its own and close it at the end: a whole handshake (key exchange,
host key, public-key authentication) for one upload, about 5 ms of CPU at the worker and as much again at the
partner, most of what a small delivery costs either side. Here a delivery that ends cleanly leaves its connection
open for LINGER_SECONDS, and the next delivery to the same destination from this worker opens its SFTP session (a
channel of its own, with nothing of the last one's state) on it instead of connecting again.

- **One delivery at a time on a connection.** A partner sees each delivery as it saw it before: one connection
  carrying one SFTP session, never two uploads sharing one.
- **Only at a partner that does not count its sessions.** Where the destination limits them (`max_sessions`, LD3),
  every connection closes as its delivery ends, as before: no idle connection waits at a partner that counts it.
- **Young connections only.** A connection is taken for MAX_AGE_SECONDS after it opened: what connecting proved
  (the partner holds the pinned host key, it accepts the credential) is never older than that. Connections are
  keyed by all that decides who connects to whom, the client key read again for each delivery, as the looks'
  sessions are (activities/partner_looks.py), and with the same bounds.
- **A delivery that failed, or was cancelled, closes its connection.** Only one that returned gives it back.
- **A kept connection that cannot open a session** (cut while it waited, or silent past the connect bound) is
  closed, and the delivery connects afresh: nothing was sent on it yet, so the delivery is the same as one that
  connected first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import asyncssh

from activities.destination import DestinationConfig
from activities.outcomes import describe
from activities.partner_connection import (
    ConnectionKey,
    close_session,
    connection_key,
    load_client_key,
    open_session,
)
from activities.partner_looks import LINGER_SECONDS, MAX_AGE_SECONDS

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Kept:
    conn: asyncssh.SSHClientConnection
    dest: DestinationConfig
    opened_at: float
    connect_timeout: float
    idle_close: asyncio.TimerHandle | None = None


class DeliveryConnections:
    """A worker's idle delivery connections, by destination; `close` ends them all."""

    def __init__(self, *, linger_seconds: float = LINGER_SECONDS, max_age_seconds: float = MAX_AGE_SECONDS) -> None:
        self.linger_seconds = linger_seconds
        self.max_age_seconds = max_age_seconds
        self.opened = 0  # connections opened since start
        self.reused = 0  # sessions opened on a kept connection since start
        self._idle: dict[ConnectionKey, list[_Kept]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        return sum(len(kept) for kept in self._idle.values())

    @asynccontextmanager
    async def session(self, dest: DestinationConfig, *, connect_timeout: float = 10.0,
                      ) -> AsyncIterator[asyncssh.SFTPClient]:
        """An SFTP session at `dest`, on a kept connection or a new one, as `partner_connection.connect` gives.
        Raises what opening a new connection raises."""
        client_key = load_client_key(dest.credential_ref)
        key = connection_key(dest, client_key)
        kept, sftp = await self._take(key, connect_timeout)
        if kept is None:
            conn, sftp = await open_session(dest, connect_timeout=connect_timeout, client_key=client_key)
            self.opened += 1
            kept = _Kept(conn, dest, asyncio.get_running_loop().time(), connect_timeout)
        assert sftp is not None
        try:
            yield sftp
        except BaseException:
            await close_session(dest, kept.conn, sftp, timeout=connect_timeout)
            raise
        await self._give_back(key, kept, sftp, dest)

    async def close(self) -> None:
        """Ends every idle connection, each within its connect bound; a delivery under way closes its own."""
        self._closed = True
        for key in list(self._idle):
            for kept in self._idle.pop(key):
                self._retire(kept)
        while self._closing:  # a delivery ending meanwhile closes its connection too
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _take(self, key: ConnectionKey, connect_timeout: float,
                    ) -> tuple[_Kept | None, asyncssh.SFTPClient | None]:
        """A kept connection with a new SFTP session on it, or (None, None) when none can give one."""
        while idle := self._idle.get(key):  # read again after each wait: others give connections back meanwhile
            kept = idle.pop()  # the last one given back: the others may linger out unused
            if not idle:
                del self._idle[key]
            if kept.idle_close is not None:
                kept.idle_close.cancel()
                kept.idle_close = None
            if not self._usable(kept):
                self._retire(kept)
                continue
            try:
                async with asyncio.timeout(connect_timeout):
                    sftp = await kept.conn.start_sftp_client()
            except (asyncssh.Error, OSError) as exc:
                log.info("a kept connection to %s:%d could not open a session (%s); connecting afresh",
                         kept.dest.host, kept.dest.port, describe(exc))
                self._retire(kept)
                continue
            except BaseException:
                self._retire(kept)
                raise
            self.reused += 1
            return kept, sftp
        return None, None

    async def _give_back(self, key: ConnectionKey, kept: _Kept, sftp: asyncssh.SFTPClient,
                         dest: DestinationConfig) -> None:
        """The delivery to `dest` returned: its session ends, and its connection waits for the next one if it may
        (by `dest`'s contract as the delivery read it, not as it was when the connection opened)."""
        try:
            sftp.exit()
            async with asyncio.timeout(kept.connect_timeout):
                await sftp.wait_closed()
        except (asyncssh.Error, OSError) as exc:
            log.debug("ending a delivery's session at %s:%d: %s", kept.dest.host, kept.dest.port, exc)
            self._retire(kept)
            return
        except BaseException:
            self._retire(kept)
            raise
        if self._closed or dest.contract.max_sessions is not None or self.linger_seconds <= 0 \
                or not self._usable(kept):
            self._retire(kept)
            return
        self._idle.setdefault(key, []).append(kept)
        kept.idle_close = asyncio.get_running_loop().call_later(self.linger_seconds, self._linger_ended, key, kept)

    def _usable(self, kept: _Kept) -> bool:
        age = asyncio.get_running_loop().time() - kept.opened_at
        return not kept.conn.is_closed() and age < self.max_age_seconds

    def _linger_ended(self, key: ConnectionKey, kept: _Kept) -> None:
        kept.idle_close = None
        idle = self._idle.get(key)
        if idle is not None and kept in idle:
            idle.remove(kept)
            if not idle:
                del self._idle[key]
        self._retire(kept)

    def _retire(self, kept: _Kept) -> None:
        if kept.idle_close is not None:
            kept.idle_close.cancel()
            kept.idle_close = None
        closing = asyncio.create_task(close_session(kept.dest, kept.conn, None, timeout=kept.connect_timeout))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

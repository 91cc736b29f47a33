"""The preparation's looks at a partner, on SSH sessions that a worker's builds share.

A look (the final directory, the final name listed: `preflight` in activities/partner_files.py) used to open a
connection of its own and close it at once: a whole SSH handshake for two small requests, costing about as much
CPU at the partner as at the worker, and one of an export's two handshakes. Here the looks of one worker at one
destination share a session while they overlap, and for LINGER_SECONDS after the last of them ends, so that builds
starting one after another share it too. Deliveries never use these sessions: a delivery's session is one of its
own, on a connection that carries one delivery at a time (activities/delivery_connections.py; LD3 counts them).

- A session takes new looks for MAX_AGE_SECONDS after it opened: what a look learns by connecting (the partner
  holds the pinned host key, it accepts the credential) is never older than that. Deliveries keep their
  connections under the same bounds.
- Where the destination limits its partner's sessions (`max_sessions`), a session closes as soon as its last look
  ends: no idle connection waits at a partner that counts them.
- A session is keyed by all that decides who connects to whom: host, port, user name, the pinned host key, and the
  client key that credential_ref names, read again for each look (a rotated key opens a new session).
- A look that finds a session it took over from earlier looks cut is made once more, on a new session. A look on a
  new session reports what it met, as a look on a connection of its own did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import asyncssh

from activities.destination import DestinationConfig
from activities.partner_connection import (
    ConnectionKey,
    close_session,
    connection_key,
    load_client_key,
    open_session,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Builds start one after another at a few a second under load, so that the next look finds the session open.
LINGER_SECONDS = 1.0
MAX_AGE_SECONDS = 5.0

# What a request on a session that was cut raises (asyncssh's ConnectionLost is a DisconnectError).
_CUT = (asyncssh.DisconnectError, asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection, ConnectionError)


@dataclass(eq=False)
class _Session:
    dest: DestinationConfig
    conn: asyncssh.SSHClientConnection
    sftp: asyncssh.SFTPClient
    opened_at: float
    connect_timeout: float
    looks: int = 0
    closed: bool = False
    idle_close: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Opening:
    task: asyncio.Task[_Session]
    waiting: int = 0


class PartnerLooks:
    """A worker's shared look sessions, at most one taking new looks per destination; `close` ends them all."""

    def __init__(self, *, linger_seconds: float = LINGER_SECONDS, max_age_seconds: float = MAX_AGE_SECONDS) -> None:
        self.linger_seconds = linger_seconds
        self.max_age_seconds = max_age_seconds
        self.opened = 0  # sessions opened since start
        self._sessions: dict[ConnectionKey, _Session] = {}
        self._opening: dict[ConnectionKey, _Opening] = {}
        self._closing: set[asyncio.Task[None]] = set()

    async def look(self, dest: DestinationConfig, look: Callable[[asyncssh.SFTPClient], Awaitable[T]], *,
                   connect_timeout: float) -> T:
        """`look`'s answer on a session at `dest`. Raises what opening a new session raises (`open_session`), and
        what `look` raises on a new one."""
        client_key = load_client_key(dest.credential_ref)
        key = connection_key(dest, client_key)
        session, taken_over = await self._take(key, dest, client_key, connect_timeout)
        try:
            return await look(session.sftp)
        except _CUT as exc:
            if not taken_over:
                raise
            log.info("a look's session at %s:%d was cut (%s); looking again on a new one", dest.host, dest.port,
                     exc)
            self._retire(key, session)
        finally:
            self._release(key, session, dest)
        session = await self._take_new(key, dest, client_key, connect_timeout)
        try:
            return await look(session.sftp)
        finally:
            self._release(key, session, dest)

    @property
    def sessions_open(self) -> int:
        """Sessions that take new looks."""
        return len(self._sessions)

    async def close(self) -> None:
        """Ends every session, each within its connect bound; looks still running on one see it cut."""
        for opening in list(self._opening.values()):
            opening.task.cancel()
        for key, session in list(self._sessions.items()):
            session.looks = 0
            self._retire(key, session)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _take(self, key: ConnectionKey, dest: DestinationConfig, client_key: asyncssh.SSHKey,
                    connect_timeout: float) -> tuple[_Session, bool]:
        """A session for one more look, and whether earlier looks used it."""
        session = self._sessions.get(key)
        if session is not None:
            if self._usable(key, session):
                if session.idle_close is not None:
                    session.idle_close.cancel()
                    session.idle_close = None
                session.looks += 1
                return session, True
            self._retire(key, session)
        return await self._take_new(key, dest, client_key, connect_timeout), False

    async def _take_new(self, key: ConnectionKey, dest: DestinationConfig, client_key: asyncssh.SSHKey,
                        connect_timeout: float) -> _Session:
        """A session no look has used yet: the one being opened for `key`, else a new one. Concurrent first looks
        wait for the same handshake."""
        opening = self._opening.get(key)
        if opening is None:
            opening = _Opening(asyncio.create_task(self._open(dest, client_key, connect_timeout)))
            self._opening[key] = opening
            opening.task.add_done_callback(lambda _: self._opened(key, opening))
        opening.waiting += 1
        try:
            session = await asyncio.shield(opening.task)
        except asyncio.CancelledError:
            opening.waiting -= 1
            if opening.waiting == 0 and opening.task.done() and not opening.task.cancelled() \
                    and opening.task.exception() is None:
                # Opened, but this look was cancelled before it could take the session: nobody will release it.
                self._release(key, opening.task.result(), dest, taken=False)
            raise
        opening.waiting -= 1
        session.looks += 1
        return session

    async def _open(self, dest: DestinationConfig, client_key: asyncssh.SSHKey, connect_timeout: float) -> _Session:
        conn, sftp = await open_session(dest, connect_timeout=connect_timeout, client_key=client_key)
        self.opened += 1
        return _Session(dest, conn, sftp, asyncio.get_running_loop().time(), connect_timeout)

    def _opened(self, key: ConnectionKey, opening: _Opening) -> None:
        if self._opening.get(key) is opening:
            del self._opening[key]
        if opening.task.cancelled() or opening.task.exception() is not None:
            return  # each look that waited has the exception; none waiting: retrieved here, nothing to keep
        session = opening.task.result()
        self._sessions[key] = session
        if opening.waiting == 0:  # every look that waited for it was cancelled
            self._release(key, session, session.dest, taken=False)

    def _usable(self, key: ConnectionKey, session: _Session) -> bool:
        """Whether the session takes new looks: the one mapped for its key (a retired one no longer is), open, and
        young enough."""
        age = asyncio.get_running_loop().time() - session.opened_at
        return self._sessions.get(key) is session and not session.conn.is_closed() and age < self.max_age_seconds

    def _release(self, key: ConnectionKey, session: _Session, dest: DestinationConfig, *, taken: bool = True) -> None:
        if taken:
            session.looks -= 1
        if session.looks > 0:
            return
        if not self._usable(key, session) or dest.contract.max_sessions is not None or self.linger_seconds <= 0:
            self._retire(key, session)
        elif session.idle_close is None:
            session.idle_close = asyncio.get_running_loop().call_later(self.linger_seconds, self._retire, key,
                                                                       session)

    def _retire(self, key: ConnectionKey, session: _Session) -> None:
        """No new looks on the session; it closes once its last look ends."""
        if self._sessions.get(key) is session:
            del self._sessions[key]
        if session.idle_close is not None:
            session.idle_close.cancel()
            session.idle_close = None
        if session.looks <= 0 and not session.closed:
            session.closed = True
            closing = asyncio.create_task(close_session(session.dest, session.conn, session.sftp,
                                                        timeout=session.connect_timeout))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

"""The worker's stop listener (activities/stop_watch.py) on its own, reaching PostgreSQL through
tests/helpers/faults.py's proxy: a build whose watch is cancelled while the listener's first connect is still
unanswered leaves no watch behind, and the listener goes on to listen for the builds that follow."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from activities.stop_watch import StopListener, StopWatch
from store.db import Bounds, asyncpg_dsn
from tests.helpers.support import eventually

BOUNDS = Bounds(statement_seconds=2.0, connect_seconds=1.5, tcp_user_timeout_seconds=4)
BOUND = 20.0


@pytest.mark.spec("PT4")
async def test_a_watch_cancelled_while_the_listener_first_connects_is_not_left_behind(db, store, proxy):
    listener = StopListener(asyncpg_dsn(proxy.url("exports_app", db.name)), BOUNDS, check_every=0.5)
    try:
        proxy.hold_new_connections()
        watch = StopWatch(listener, store, uuid.uuid4(), uuid.uuid4(), on_stop=lambda: None)
        entering = asyncio.create_task(watch.__aenter__())
        await asyncio.sleep(0.5)
        assert not entering.done(), "entered before the listener's first try ended"
        entering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(entering, BOUND)
        assert listener._watches == {}, listener._watches  # the only place a watch is held

        proxy.accept_new_connections()
        async with StopWatch(listener, store, uuid.uuid4(), uuid.uuid4(), on_stop=lambda: None):
            await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n >= 1, timeout=BOUND,
                             what="the listener listening")
            assert len(listener._watches) == 1
        assert listener._watches == {}
    finally:
        proxy.accept_new_connections()
        await listener.close()
    await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                     what="the listener closed")

"""Case PT1 with real faults: the proxy between the store and PostgreSQL goes silent (tests/helpers/faults.py:
nothing forwarded either way, no socket closed, as a network that drops packets), so only the client's own bounds
can end a wait. Every statement and connect ends within its bound as an uncertain answer, handled as a lost
response is, and the store works again once the partition heals. The row in the database is the authority."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import asyncpg
import pytest

from store import errors
from store.db import Bounds, connect_raw, make_engine
from store.jobs import JobStore
from store.models import ClaimResult
from tests.helpers.events import events, kinds
from tests.helpers.faults import CLAIM_STATEMENT
from tests.helpers.support import create_job, seed_tenant

T = TypeVar("T")

STATEMENT = 1.5  # seconds: the bounds under test, short so that the test runs in seconds
CONNECT = 1.5
REREAD = 1.0
BOUNDS = Bounds(statement_seconds=STATEMENT, connect_seconds=CONNECT, tcp_user_timeout_seconds=4)
LATE = 1.0  # how late a bound may fire on a loaded machine
BOUND = 20.0  # the test's own bound on any one call: far past every bound above


async def timed(call: Awaitable[T]) -> tuple[T | BaseException, float]:
    """What the call returned or raised, and how long it took (never longer than BOUND)."""
    started = time.monotonic()
    try:
        result: T | BaseException = await asyncio.wait_for(call, BOUND)
    except TimeoutError as exc:
        if time.monotonic() - started >= BOUND:
            raise AssertionError(f"no answer within the test's own bound of {BOUND:g} s") from exc
        result = exc
    except Exception as exc:
        result = exc
    return result, time.monotonic() - started


@pytest.fixture
async def cut_off(db, proxy) -> AsyncIterator[JobStore]:
    """The application role's store through the proxy, with the bounds under test."""
    engine = make_engine(proxy.url("exports_app", db.name), bounds=BOUNDS)
    try:
        yield JobStore(engine, lease_seconds=5, reread_timeout_seconds=REREAD)
    finally:
        proxy.heal()  # whatever failed, nothing waits on the silence
        await engine.dispose()


async def job_row(db, job_id: uuid.UUID) -> dict[str, Any]:
    return dict(await db.admin.fetchrow("SELECT status, attempt_id, version FROM export_jobs WHERE id = $1", job_id))


@pytest.mark.spec("PT1")
async def test_a_write_whose_answer_a_silent_partition_holds_is_uncertain_within_its_bound(db, store, proxy, cut_off):
    """The claim commits on the server and the network goes silent before its answer comes back: the claim's
    bound fires, its re-read is bounded too, and the caller hears Unknown, as after a lost response. Once the
    partition heals (the connections open during it never come back, as after a NAT table flush), the pool
    replaces them and the same claim, asked again, finds its own commit."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    assert (await timed(cut_off.read_job(job_id)))[1] < BOUND  # one pooled connection, before the partition
    attempt_id = uuid.uuid4()
    fired = proxy.silent_after_commit(CLAIM_STATEMENT)

    answer, took = await timed(cut_off.claim(job_id, 1, attempt_id, "worker-a"))
    print(f"PT1: a claim answered {answer} {took:.2f} s into a silent partition")
    assert fired.is_set() and proxy.silent
    assert answer is ClaimResult.UNKNOWN
    # The statement's bound, then the re-read's (whose new connection waits on the same silence).
    assert took < STATEMENT + REREAD + LATE
    row = await job_row(db, job_id)
    assert row["status"] == "Running" and row["attempt_id"] == attempt_id  # it did commit, unheard

    proxy.heal(keep_open_connections=False)
    answer, took = await timed(cut_off.claim(job_id, 1, attempt_id, "worker-a"))
    print(f"PT1: the same claim after the heal answered {answer} in {took:.2f} s")
    assert answer is ClaimResult.CLAIMED and took < CONNECT + LATE
    assert kinds(await events(db, job_id)) == ["Claimed"]  # claimed once


@pytest.mark.spec("PT1")
async def test_a_statement_into_a_silent_partition_fails_within_its_bound_as_an_uncertain_answer(
        db, store, proxy, cut_off):
    """A statement sent into the silence (it never reaches the server) fails within its bound with an error that
    store/errors.py calls uncertain and transient, on a pooled connection and on a raw one (a LISTEN); once the
    partition heals the pool works again."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    assert (await timed(cut_off.read_job(job_id)))[1] < BOUND
    raw = await asyncio.wait_for(connect_raw(proxy.url("exports_app", db.name), BOUNDS), BOUND)
    try:
        proxy.go_silent()
        renewal, took = await timed(cut_off.renew_lease(job_id, uuid.uuid4()))
        print(f"PT1: a renewal failed {took:.2f} s into a silent partition: {renewal!r}")
        assert isinstance(renewal, BaseException), renewal
        assert errors.is_uncertain(renewal) and errors.is_transient(renewal)
        assert not errors.is_deterministic(renewal)
        assert took < STATEMENT + LATE

        listen, took = await timed(raw.add_listener("exports_stop", lambda *args: None))
        print(f"PT1: a LISTEN failed {took:.2f} s into a silent partition: {listen!r}")
        assert isinstance(listen, BaseException) and errors.is_uncertain(listen), listen
        assert took < STATEMENT + LATE
    finally:
        raw.terminate()
    assert await job_row(db, job_id) == {"status": "Queued", "attempt_id": None, "version": 1}

    proxy.heal(keep_open_connections=False)
    found, took = await timed(cut_off.read_job(job_id))
    print(f"PT1: the pool answered {took:.2f} s after the heal")
    assert not isinstance(found, BaseException) and found is not None and found.id == job_id, found
    assert took < CONNECT + LATE


@pytest.mark.spec("PT1")
async def test_a_connect_into_a_silent_partition_fails_within_its_bound(db, proxy, cut_off):
    """A new connection (accepted by the network, never answered) fails within the connect bound: the pool's and
    a raw one's alike. After the heal both connect."""
    proxy.go_silent()
    for what, connect in (("the pool", cut_off.ping),
                          ("a raw connection", lambda: connect_raw(proxy.url("exports_app", db.name), BOUNDS))):
        failed, took = await timed(connect())
        print(f"PT1: {what} failed to connect {took:.2f} s into a silent partition: {failed!r}")
        assert isinstance(failed, BaseException) and errors.is_uncertain(failed), failed
        assert took < CONNECT + LATE
    assert proxy.accepted == 0  # nothing reached the server

    proxy.heal()
    assert (await timed(cut_off.ping()))[0] is None
    raw = await asyncio.wait_for(connect_raw(proxy.url("exports_app", db.name), BOUNDS), BOUND)
    raw.terminate()


def _tcp_options(conn: asyncpg.Connection) -> dict[str, int]:
    sock = conn._transport.get_extra_info("socket")  # type: ignore[attr-defined]
    return {"SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            **{name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
               for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")}}


@pytest.mark.spec("PT1")
@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
async def test_connections_over_tcp_have_keepalives_and_a_user_timeout(db, proxy, cut_off):
    """A peer gone silent is dropped by the kernel after the user timeout, idle (keepalive probes unanswered) or
    not (data unacknowledged): the pool's connections and the raw ones (COPY, LISTEN) carry both."""
    expected = {"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 2, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 4000}
    async with cut_off.engine.connect() as conn:
        pooled = (await conn.get_raw_connection()).driver_connection
        assert _tcp_options(pooled) == expected
    raw = await asyncio.wait_for(connect_raw(proxy.url("exports_app", db.name), BOUNDS), BOUND)
    try:
        assert _tcp_options(raw) == expected
    finally:
        raw.terminate()

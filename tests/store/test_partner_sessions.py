"""take_partner_session.sql (LD3) against the database alone: attempts racing for the last session, a limit lowered
under slots still held, a limit cleared while an attempt waits, and an upload's hold on its session."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from store.models import Status
from tests.helpers.store_states import drive
from tests.helpers.support import create_job


async def _live_attempts(store, tenant, n: int) -> list[tuple[uuid.UUID, uuid.UUID]]:  # type: ignore[no-untyped-def]
    tenant_id, destination_id = tenant
    out = []
    for _ in range(n):
        job = await create_job(store, tenant_id, destination_id)
        out.append((job, await drive(store, job, Status.RUNNING)))
    return out


async def _slots(store, destination_id, attempts) -> list[int | None]:  # type: ignore[no-untyped-def]
    answers = await asyncio.gather(*(store.take_partner_session(destination_id, job, attempt)
                                     for job, attempt in attempts))
    return [answer.slot for answer in answers]


async def _live(db, destination_id) -> int:  # type: ignore[no-untyped-def]
    return await db.admin.fetchval(
        "SELECT count(*) FROM partner_sessions s JOIN export_jobs j ON j.id = s.job_id AND j.attempt_id = s.attempt_id"
        " AND j.status IN ('Running', 'Delivering') WHERE s.destination_id = $1", destination_id)


async def _end(db, job: uuid.UUID) -> None:  # type: ignore[no-untyped-def]
    """The attempt's row moves on, as its terminal write (or recovery's takeover) moves it."""
    await db.admin.execute("UPDATE export_jobs SET status = 'Failed', failure_reason = 'BuildFailed' WHERE id = $1",
                           job)


@pytest.mark.spec("LD3")
async def test_attempts_racing_for_the_last_sessions_never_hold_more_than_the_limit(db, store, tenant):
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 2 WHERE id = $1", destination_id)
    attempts = await _live_attempts(store, tenant, 12)
    for round_ in range(5):
        # Asked again until both are taken: a racer that finds another waiter ahead of it (asked first, no slot
        # yet) leaves the slot to it, so a round of concurrent asks may end with one taken and the next serves it.
        for _ in range(len(attempts)):
            got = await _slots(store, destination_id, attempts)
            assert await _live(db, destination_id) <= 2, (round_, got)
            if sum(slot is not None for slot in got) == 2:
                break
        assert sorted(slot for slot in got if slot is not None) == [1, 2], (round_, got)
        assert await _live(db, destination_id) == 2
        # The holders give their slots back, as at their ends, and the others race again with new ones.
        holders = [attempt for attempt, slot in zip(attempts, got, strict=True) if slot is not None]
        for job, attempt in holders:
            await store.release_partner_session(job, attempt)
        attempts = [a for a in attempts if a not in holders] + await _live_attempts(store, tenant, len(holders))


@pytest.mark.spec("LD3")
async def test_a_lowered_limit_is_not_exceeded_while_slots_above_it_are_held(db, store, tenant):
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 3 WHERE id = $1", destination_id)
    first = await _live_attempts(store, tenant, 3)
    assert [(await store.take_partner_session(destination_id, *attempt)).slot for attempt in first] == [1, 2, 3]
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    others = await _live_attempts(store, tenant, 6)
    assert await _slots(store, destination_id, others) == [None] * 6
    for job, _ in first[:2]:
        await _end(db, job)
    assert await _slots(store, destination_id, others) == [None] * 6  # slot 3 still live: 1 at once
    await _end(db, first[2][0])
    assert sorted(slot for slot in await _slots(store, destination_id, others) if slot is not None) == [1]
    assert await _live(db, destination_id) == 1


@pytest.mark.spec("LD3")
async def test_a_limit_cleared_while_an_attempt_waits_is_answered_as_no_limit(db, store, tenant):
    """Seen failing: the statement answered no row at all once the limit was cleared (generate_series(1, NULL)),
    which the waiting attempt took for every slot held, and asked again every second."""
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    holder, waiter = await _live_attempts(store, tenant, 2)
    assert (await store.take_partner_session(destination_id, *holder)).slot == 1
    waiting = await store.take_partner_session(destination_id, *waiter)
    assert (waiting.limit, waiting.slot) == (1, None)
    await db.admin.execute("UPDATE destinations SET max_sessions = NULL WHERE id = $1", destination_id)
    cleared = await store.take_partner_session(destination_id, *waiter)
    assert (cleared.limit, cleared.slot) == (None, None)
    # The holder is told its slot, and that there is no limit now.
    held = await store.take_partner_session(destination_id, *holder)
    assert (held.limit, held.slot) == (None, 1)


@pytest.mark.spec("LD3")
async def test_an_upload_keeps_its_session_after_its_row_moves_on_until_its_hold_lapses(db, store, tenant):
    """Recovery may take an attempt back while its upload still runs (its worker cut off from the database, or
    late): the upload's hold (keep_partner_session.sql) keeps the slot its own until it lapses."""
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    uploading, waiter = await _live_attempts(store, tenant, 2)
    assert (await store.take_partner_session(destination_id, *uploading)).slot == 1
    assert await store.keep_partner_session(*uploading)
    await _end(db, uploading[0])  # taken back: the row no longer names the attempt
    assert (await store.take_partner_session(destination_id, *waiter)).slot is None
    # Its worker renews no more: the hold lapses a lease after the last renewal, and the slot is free.
    await db.admin.execute("UPDATE partner_sessions SET uploading_until = clock_timestamp() - interval '1 second' "
                           "WHERE job_id = $1", uploading[0])
    assert (await store.take_partner_session(destination_id, *waiter)).slot == 1
    assert await db.admin.fetchval("SELECT uploading_until FROM partner_sessions WHERE job_id = $1", waiter[0]) \
        is None
    assert not await store.keep_partner_session(*uploading)  # it holds none now


async def _asked_ago(db, job: uuid.UUID, seconds: float) -> None:  # type: ignore[no-untyped-def]
    await db.admin.execute("UPDATE partner_session_waits SET asked_at = clock_timestamp() - make_interval(secs => $2) "
                           "WHERE job_id = $1", job, seconds)


@pytest.mark.spec("LD3")
async def test_a_freed_session_goes_to_the_waiter_that_asked_first_not_to_whoever_asks_next(db, store, tenant):
    """Found by review: a freed slot went to whoever asked first after it was freed, so a waiter could be overtaken
    round after round by exports that began waiting after it (the worker-level race is in
    tests/workflows/test_partner_sessions.py)."""
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    holder, first, second = await _live_attempts(store, tenant, 3)
    assert (await store.take_partner_session(destination_id, *holder)).slot == 1
    assert (await store.take_partner_session(destination_id, *first)).slot is None  # waits from now
    assert (await store.take_partner_session(destination_id, *second)).slot is None  # behind it
    await store.release_partner_session(*holder)
    assert (await store.take_partner_session(destination_id, *second)).slot is None  # asks first, is not first
    assert (await store.take_partner_session(destination_id, *first)).slot == 1
    await store.release_partner_session(*first)
    assert (await store.take_partner_session(destination_id, *second)).slot == 1
    assert await db.admin.fetchval(
        "SELECT count(*) FROM partner_session_waits WHERE job_id = ANY($1::uuid[])", [first[0], holder[0]]) == 0


@pytest.mark.spec("LD3")
async def test_a_waiter_that_stopped_asking_or_whose_attempt_ended_holds_no_one_back(db, store, tenant):
    _, destination_id = tenant
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    paused, ended, later = await _live_attempts(store, tenant, 3)
    for attempt in (paused, ended, later):
        assert (await store.take_partner_session(destination_id, *attempt)).slot == (1 if attempt is paused else None)
    await store.release_partner_session(*paused)
    assert (await store.take_partner_session(destination_id, *paused)).slot is None  # ...now behind `ended`
    await _asked_ago(db, paused[0], 6)  # its worker paused: silent past the bound
    await _end(db, ended[0])  # its attempt gone (its worker died before it could give its place back)
    assert (await store.take_partner_session(destination_id, *later)).slot == 1
    # A waiter silent for long is forgotten by the next ask at its destination; one asking again keeps its place.
    await _asked_ago(db, ended[0], 601)
    await store.take_partner_session(destination_id, *paused)
    assert await db.admin.fetchval("SELECT count(*) FROM partner_session_waits WHERE job_id = $1", ended[0]) == 0
    assert await db.admin.fetchval("SELECT count(*) FROM partner_session_waits WHERE job_id = $1", paused[0]) == 1


@pytest.mark.spec("LD3")
async def test_no_limit_no_place_kept(db, store, tenant):
    _, destination_id = tenant
    (job, attempt), = await _live_attempts(store, tenant, 1)
    assert await store.take_partner_session(destination_id, job, attempt) == (None, None)
    assert await db.admin.fetchval("SELECT count(*) FROM partner_session_waits") == 0

"""The preparation's looks on shared sessions (activities/partner_looks.py) against a real SFTP partner: what they
share, when a session stops taking looks and closes, and that no look rides on a session another destination's
settings opened."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from activities.destination import PartnerContract
from activities.partner_connection import HostKeyMismatch
from activities.partner_files import preflight
from activities.partner_looks import PartnerLooks
from starter.localstack.partner import LocalPartner
from tests.helpers.partner import bounded
from tests.helpers.support import eventually

NAME = "contacts-x.csv"


@pytest.fixture
async def looks() -> AsyncIterator[PartnerLooks]:
    shared = PartnerLooks(linger_seconds=0.3, max_age_seconds=5.0)
    try:
        yield shared
    finally:
        await bounded(shared.close())


async def look(partner: LocalPartner, looks: PartnerLooks, **overrides: object) -> bool:
    """Whether the final name exists, by the preparation's look."""
    return (await bounded(preflight(partner.destination(**overrides), NAME, timeout=5.0, looks=looks))).exists


async def closed(partner: LocalPartner, looks: PartnerLooks, within: float) -> None:
    await eventually(lambda: asyncio.sleep(0, (looks.sessions_open, partner.open_connections)),
                     lambda counts: counts == (0, 0), timeout=within, what="every look session closed")


async def test_looks_one_after_another_share_a_session_until_it_lingers_out(partner, looks):
    assert not await look(partner, looks)
    (partner.final_dir / NAME).write_text("x")
    assert await look(partner, looks), "the second look saw the partner as it was at the first"
    assert (partner.accepted_connections, looks.opened) == (1, 1)
    assert partner.open_connections == 1  # lingering
    await closed(partner, looks, within=3.0)


async def test_looks_at_once_wait_for_one_handshake(partner, looks):
    assert await bounded(asyncio.gather(*(look(partner, looks) for _ in range(5)))) == [False] * 5
    assert partner.accepted_connections == 1


async def test_a_destination_that_counts_its_sessions_keeps_none_idle(partner):
    looks = PartnerLooks(linger_seconds=60.0)
    try:
        await look(partner, looks, contract=PartnerContract(max_sessions=2))
        # Closed at once, not after the minute's linger.
        await closed(partner, looks, within=3.0)
    finally:
        await bounded(looks.close())


async def test_a_session_past_its_age_takes_no_new_look(partner):
    looks = PartnerLooks(linger_seconds=60.0, max_age_seconds=0.2)
    try:
        await look(partner, looks)
        await asyncio.sleep(0.3)
        await look(partner, looks)
        assert (partner.accepted_connections, looks.opened) == (2, 2)
        await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 1, timeout=3.0,
                         what="the old session closed")
    finally:
        await bounded(looks.close())


async def test_a_look_that_finds_its_session_cut_looks_again_on_a_new_one(partner, looks, caplog):
    await look(partner, looks)
    # Cut with no await before the next look: the worker's side has not seen it go, so the look takes it.
    partner.close_connections()
    with caplog.at_level(logging.INFO, logger="activities.partner_looks"):
        assert not await look(partner, looks)
    assert any("was cut" in record.getMessage() for record in caplog.records), "the look did not meet the cut"
    assert (partner.accepted_connections, looks.opened) == (2, 2)


async def test_another_pinned_host_key_never_rides_on_an_open_session(partner, looks):
    await look(partner, looks)
    wrong = LocalPartner(partner.root.parent / "other", host_key_path=partner.root.parent / "other_key")
    await bounded(wrong.start())
    try:
        with pytest.raises(HostKeyMismatch):
            await look(partner, looks, host_key=wrong.host_key_line)
    finally:
        await bounded(wrong.stop())
    assert partner.accepted_connections == 2, "the mismatch was not found on a handshake of its own"


async def test_a_look_cancelled_during_the_handshake_leaves_no_session_behind(partner, looks):
    held = asyncio.Event()
    asked = asyncio.Event()

    async def hold() -> None:
        asked.set()
        await held.wait()

    partner.hooks.on_session = hold
    waiting = asyncio.create_task(look(partner, looks))
    await bounded(asked.wait())
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    held.set()
    await eventually(lambda: asyncio.sleep(0, looks.opened), lambda n: n == 1, timeout=3.0, what="the session open")
    await closed(partner, looks, within=3.0)


async def test_close_ends_every_session(partner):
    looks = PartnerLooks(linger_seconds=60.0)
    await look(partner, looks)
    assert partner.open_connections == 1
    await bounded(looks.close())
    await closed(partner, looks, within=3.0)

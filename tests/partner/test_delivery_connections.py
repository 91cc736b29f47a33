"""Deliveries that hand their SSH connection on to the next one (activities/delivery_connections.py), against a real
SFTP partner: what is shared and when, that a partner never sees two uploads on one connection, and that a
connection which failed, was cut while it waited, belongs to a partner that counts its sessions, or is too old,
is never used again."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from activities.delivery_connections import DeliveryConnections
from activities.destination import PartnerContract
from activities.outcomes import DeliveryResult
from activities.partner_delivery import deliver
from starter.localstack.partner import LocalPartner
from tests.helpers.partner import Evidence, bounded, make_file
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy

CHUNK = 16 * 1024


@pytest.fixture
async def kept() -> AsyncIterator[DeliveryConnections]:
    connections = DeliveryConnections(linger_seconds=5.0, max_age_seconds=30.0)
    try:
        yield connections
    finally:
        await bounded(connections.close())


@pytest.fixture
def files(tmp_path: Path) -> list[tuple[Path, bytes]]:
    made = []
    for n in range(4):
        path = tmp_path / f"contacts-{n}.csv"
        made.append((path, make_file(path, 3 * CHUNK + n)))
    return made


async def send(partner: LocalPartner, connections: DeliveryConnections, file: tuple[Path, bytes], name: str,
               **overrides: object) -> tuple[DeliveryResult, Evidence]:
    evidence = Evidence()
    result = await bounded(deliver(partner.destination(**overrides), str(file[0]), f"contacts-{name}.csv",
                                   f"{name}.part", record_evidence=evidence, chunk_size=CHUNK,
                                   connections=connections))
    return result, evidence


def delivered(partner: LocalPartner, name: str, data: bytes) -> bool:
    final = partner.final_dir / f"contacts-{name}.csv"
    return final.exists() and hashlib.sha256(final.read_bytes()).digest() == hashlib.sha256(data).digest()


async def test_deliveries_one_after_another_share_one_connection_and_it_closes_after_its_linger(
        partner: LocalPartner, files: list[tuple[Path, bytes]]) -> None:
    connections = DeliveryConnections(linger_seconds=0.5, max_age_seconds=30.0)
    try:
        for n, file in enumerate(files):
            result, evidence = await send(partner, connections, file, str(n))
            assert result.outcome == "Completed", result.summary
            assert evidence.steps == ["baseline", "rename", "receipt"]
            assert delivered(partner, str(n), file[1])
        assert (partner.accepted_connections, connections.opened, connections.reused) == (1, 1, len(files) - 1)
        assert connections.idle == 1 and partner.open_connections == 1
        await eventually(lambda: asyncio.sleep(0, (connections.idle, partner.open_connections)),
                         lambda counts: counts == (0, 0), timeout=10, what="the idle connection closed")
    finally:
        await bounded(connections.close())


async def test_a_partner_that_counts_its_sessions_sees_each_delivery_on_a_connection_of_its_own(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    for n, file in enumerate(files[:3]):
        result, _ = await send(partner, kept, file, str(n), contract=PartnerContract(max_sessions=2))
        assert result.outcome == "Completed", result.summary
        assert kept.idle == 0
    assert (partner.accepted_connections, kept.reused) == (3, 0)
    await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 0, timeout=10,
                     what="every delivery's connection closed")


async def test_deliveries_at_once_never_share_a_connection(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    sessions_asked: list[int] = []
    both_waiting = asyncio.Event()

    async def hold_until_all_ask() -> None:
        # Every delivery asks for its session before any gets one: they overlap for certain.
        sessions_asked.append(partner.open_connections)
        if len(sessions_asked) == 3:
            both_waiting.set()
        await asyncio.wait_for(both_waiting.wait(), 10)

    partner.hooks.on_session = hold_until_all_ask
    # Kept connections from an earlier round would be taken first: none yet.
    results = await asyncio.gather(*(send(partner, kept, file, str(n)) for n, file in enumerate(files[:3])))
    partner.hooks.on_session = None
    assert [result.outcome for result, _ in results] == ["Completed"] * 3
    assert (partner.accepted_connections, kept.opened, kept.reused) == (3, 3, 0)
    assert kept.idle == 3
    # The next delivery takes one of them.
    result, _ = await send(partner, kept, files[3], "3")
    assert result.outcome == "Completed" and (partner.accepted_connections, kept.reused) == (3, 1)


async def test_a_kept_connection_cut_while_it_waited_is_replaced_and_the_delivery_is_as_if_it_connected_first(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    result, _ = await send(partner, kept, files[0], "0")
    assert result.outcome == "Completed" and kept.idle == 1
    partner.close_connections()  # the network drops the idle connection, without a goodbye
    result, evidence = await send(partner, kept, files[1], "1")
    assert result.outcome == "Completed", result.summary
    assert evidence.steps == ["baseline", "rename", "receipt"]  # no failure met, nothing recorded of the cut
    assert delivered(partner, "1", files[1][1])
    assert (partner.accepted_connections, kept.opened, kept.reused) == (2, 2, 0)


async def test_a_delivery_that_failed_closes_its_connection_and_the_next_connects_afresh(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    result, _ = await send(partner, kept, files[0], "0")
    assert result.outcome == "Completed" and kept.idle == 1

    async def refuse_writes(path: str, offset: int) -> None:
        raise PermissionError("the partner's disk is read-only")

    partner.hooks.on_write = refuse_writes
    failed, _ = await send(partner, kept, files[1], "1")
    partner.hooks.on_write = None
    assert failed.outcome == "Failed", failed.summary
    assert kept.reused == 1 and kept.idle == 0  # it took the kept one, and did not give it back
    await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 0, timeout=10,
                     what="the failed delivery's connection closed")
    result, _ = await send(partner, kept, files[2], "2")
    assert result.outcome == "Completed" and (partner.accepted_connections, kept.opened) == (3, 2)


async def test_a_cancelled_delivery_gives_no_connection_back(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    writing = asyncio.Event()

    async def stall(path: str, offset: int) -> None:
        writing.set()
        await asyncio.sleep(30)

    partner.hooks.on_write = stall
    delivery = asyncio.create_task(deliver(partner.destination(), str(files[0][0]), "contacts-0.csv", "0.part",
                                           record_evidence=Evidence(), chunk_size=CHUNK, connections=kept))
    await bounded(writing.wait())
    delivery.cancel()
    result = await bounded(asyncio.shield(delivery))  # a cancelled delivery still answers what happened
    partner.hooks.on_write = None
    assert result.outcome != "Completed"
    assert kept.idle == 0 and kept.reused == 0
    await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 0, timeout=10,
                     what="the cancelled delivery's connection closed")


async def test_a_connection_past_its_age_is_not_taken(partner: LocalPartner, files: list[tuple[Path, bytes]]) -> None:
    connections = DeliveryConnections(linger_seconds=5.0, max_age_seconds=0.5)
    try:
        result, _ = await send(partner, connections, files[0], "0")
        assert result.outcome == "Completed" and connections.idle == 1
        await asyncio.sleep(0.6)
        result, _ = await send(partner, connections, files[1], "1")
        assert result.outcome == "Completed"
        assert (partner.accepted_connections, connections.reused) == (2, 0)
    finally:
        await bounded(connections.close())


async def test_shutting_down_closes_the_idle_connections(
        partner: LocalPartner, files: list[tuple[Path, bytes]]) -> None:
    connections = DeliveryConnections(linger_seconds=60.0, max_age_seconds=60.0)
    result, _ = await send(partner, connections, files[0], "0")
    assert result.outcome == "Completed" and partner.open_connections == 1
    await bounded(connections.close())
    await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 0, timeout=5,
                     what="the idle connection closed at shutdown")
    # A delivery that ends after the shutdown began keeps nothing open.
    result, _ = await send(partner, connections, files[1], "1")
    assert result.outcome == "Completed" and connections.idle == 0


async def test_a_kept_connection_gone_silent_is_given_up_within_the_connect_bound(
        partner: LocalPartner, kept: DeliveryConnections) -> None:
    """Packets dropped on the idle connection, nothing closed: its session request goes unanswered, and after the
    connect bound the delivery connects afresh (here once the network is back)."""
    async with TcpCutProxy(partner.host, partner.port) as proxy:
        dest = partner.destination(host="127.0.0.1", port=proxy.port)
        async with kept.session(dest, connect_timeout=1.0) as sftp:
            await bounded(sftp.stat(dest.final_dir))
        assert kept.idle == 1
        proxy.go_silent()
        loop = asyncio.get_running_loop()
        loop.call_later(1.5, proxy.heal)
        started = loop.time()
        async with kept.session(dest, connect_timeout=1.0) as sftp:
            waited = loop.time() - started
            await bounded(sftp.stat(dest.final_dir))
        assert (proxy.accepted, kept.opened, kept.reused) == (2, 2, 0)
        assert 1.0 <= waited < 5.0, f"the session came after {waited:.1f} s"


async def test_a_limit_on_sessions_set_while_a_connection_waited_closes_it_after_its_delivery(
        partner: LocalPartner, kept: DeliveryConnections, files: list[tuple[Path, bytes]]) -> None:
    result, _ = await send(partner, kept, files[0], "0")
    assert result.outcome == "Completed" and kept.idle == 1
    # The operator sets max_sessions: the next delivery still rides the connection it finds, counted as its
    # session, and closes it at its end by the contract it read.
    result, _ = await send(partner, kept, files[1], "1", contract=PartnerContract(max_sessions=1))
    assert result.outcome == "Completed" and (kept.reused, kept.idle) == (1, 0)
    await eventually(lambda: asyncio.sleep(0, partner.open_connections), lambda n: n == 0, timeout=10,
                     what="the connection closed after the limited delivery")

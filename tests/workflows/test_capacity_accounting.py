"""The worker's slot accounting on its own (activities/capacity.py), without a worker: what the capacity tests
with real components rely on, in the orders that are hard to arrange with them (a parked claim's poll released
before or after another, a claim that went ahead of an idle poll)."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

from activities.capacity import WorkerCapacity
from activities.export_base import ExportActivitiesBase


def key() -> tuple[uuid.UUID, uuid.UUID]:
    return uuid.uuid4(), uuid.uuid4()


async def test_a_parked_claims_ticket_is_returned_once_whatever_the_order_of_the_releases():
    capacity = WorkerCapacity(max_builds=2, max_uploads=2)
    builds = capacity.builds
    await builds.ticket()  # two polls
    await builds.ticket()
    first, second = builds.claim_started(), builds.claim_started()
    assert first is not None and second is not None
    assert builds.park()  # the first waits for its destination: the worker may poll again
    assert builds.in_use == 1 and builds.free
    await builds.unpark(ticket=True, wait=False)  # it gives up
    builds.claim_ended(first)
    builds.claim_ended(second)
    builds.return_ticket()  # the two polls released, in either order
    builds.return_ticket()
    assert builds.in_use == 0 and builds.free


async def test_a_claim_that_waited_for_its_destination_goes_ahead_of_an_idle_poll_and_the_next_claim_does_not_fit():
    capacity = WorkerCapacity(max_builds=1, max_uploads=2)
    builds = capacity.builds
    await builds.ticket()
    waiting = builds.claim_started()
    assert waiting is not None and builds.park()
    await builds.ticket()  # an idle poll takes the ticket the parked claim left
    assert not builds.free
    await asyncio.wait_for(builds.unpark(ticket=True, wait=True), 1)  # an idle poll is no load: not waited for
    builds.hold(key(), adopt_within=60, claim=waiting)
    assert builds.claim_started() is None  # the idle poll's task, arriving now, does not claim here
    builds.claim_ended(waiting)  # ended already by its hold: counted once
    assert builds.claim_started() is None


async def test_a_destination_holds_its_share_and_a_waiting_claim_gets_the_place_its_release_frees():
    capacity = WorkerCapacity(max_builds=4, max_uploads=4, destination_share=1)
    destination, other = uuid.uuid4(), uuid.uuid4()
    first, second, elsewhere = key(), key(), key()
    assert capacity.shares.reserve(destination, first)
    capacity.shares.settle(first, claimed=True)
    capacity.builds.hold(first, adopt_within=60)
    assert not capacity.shares.reserve(destination, second)
    assert capacity.shares.reserve(other, elsewhere)  # another destination is not held back
    waiter = asyncio.create_task(capacity.shares.wait_for_room(destination, second, 5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    capacity.release(first)  # its attempt ends here
    assert await asyncio.wait_for(waiter, 1)
    assert capacity.shares.in_flight(destination) == 1
    capacity.shares.settle(second, claimed=False)  # its claim lost: the place is free again
    assert capacity.shares.in_flight(destination) == 0
    assert await capacity.shares.wait_for_room(destination, key(), 0.0)  # room at once: no wait


async def test_an_upload_that_takes_its_slot_again_waits_for_its_destinations_place():
    """Found by review: with 2 builds and 2 uploads a destination's share is 1, which leaves one upload slot to the
    others. A1 to D was authorized; its keeper gave up waiting for the upload and freed its slot and place, and A2
    to D took them. A1's late `deliver` then took an upload slot again, counted whatever the share: D held every
    upload slot of the worker, and an export to E waited behind D's uploads. Now it waits for D's place."""
    capacity = WorkerCapacity(max_builds=2, max_uploads=2)
    assert capacity.shares.limit == 1
    d, e = uuid.uuid4(), uuid.uuid4()
    worker = SimpleNamespace(capacity=capacity)
    worker._place = lambda dest, k, details: ExportActivitiesBase._place(worker, dest, k, details)
    worker._slot_for = lambda slots, k, details: ExportActivitiesBase._slot_for(worker, slots, k, details)

    def attempt(destination: uuid.UUID) -> tuple[SimpleNamespace, uuid.UUID]:
        return SimpleNamespace(id=uuid.uuid4(), destination_id=destination), uuid.uuid4()

    async def upload_slot(job: SimpleNamespace, attempt_id: uuid.UUID) -> None:
        await ExportActivitiesBase._slot(worker, capacity.uploads, job, attempt_id, {})

    def claimed(job: SimpleNamespace, attempt_id: uuid.UUID) -> None:
        key = (job.id, attempt_id)
        assert capacity.shares.reserve(job.destination_id, key)
        capacity.builds.hold(key, adopt_within=60)
        capacity.shares.settle(key, claimed=True)

    a1, a2, other = attempt(d), attempt(d), attempt(e)
    claimed(*a1)
    await upload_slot(*a1)
    capacity.builds.release((a1[0].id, a1[1]))
    capacity.release((a1[0].id, a1[1]))  # its keeper gave up waiting for the upload
    claimed(*a2)
    await upload_slot(*a2)
    capacity.builds.release((a2[0].id, a2[1]))
    late = asyncio.ensure_future(upload_slot(*a1))  # A1's late deliver
    await asyncio.sleep(0.2)
    assert not late.done() and capacity.shares.in_flight(d) == 1 and capacity.uploads.free
    claimed(*other)
    await asyncio.wait_for(upload_slot(*other), 2)  # E's export takes the slot left for the others
    capacity.release((a2[0].id, a2[1]))  # A2's upload ends: D's place is free
    capacity.release((other[0].id, other[1]))
    await asyncio.wait_for(late, 2)
    assert capacity.uploads.holds((a1[0].id, a1[1])) and capacity.shares.in_flight(d) == 1

"""The worker's slot accounting on its own (activities/capacity.py), without a worker: what the capacity tests
with real components rely on, in the orders that are hard to arrange with them (a parked claim's poll released
before or after another, a claim that went ahead of an idle poll)."""

from __future__ import annotations

import asyncio
import uuid

from activities.capacity import WorkerCapacity


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

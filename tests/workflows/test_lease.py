"""Leases through the real in-process worker, the Temporal dev server, PostgreSQL and the SFTP partner: long builds
and uploads, paused attempts, takeovers by recovery, and the lease keeper's renewals (LB, LU, RN, PA).

Attempts are held at the named checkpoints of activities/checkpoints.py, exactly as a paused worker would be held;
renewals are refused with the fault proxy between the worker and PostgreSQL. Calls to the worker's own store are
recorded (never changed) so that a test can tell which renewal or cutoff ran, when, and what it returned. Every
assertion about state is made against the row and its events, and against the partner's directories.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from activities.checkpoints import AFTER_RECEIPT, BEFORE_CUTOFF_2, BUILD_STARTED
from store.models import AuthorizationResult, Status
from tests.helpers.events import events, kinds
from tests.helpers.harness import Harness, run_recovery
from tests.helpers.lease import (
    BOUND,
    LEASE,
    RENEWAL,
    Hold,
    RenewalBlocker,
    first_attempt,
    history,
    lease_harness,
    lease_state,
    open_proxy,
    wait_expired,
    wait_status,
)
from tests.helpers.partner import assert_partner_holds
from tests.helpers.support import built_files, eventually
from workflows.identity import export_workflow_id

# --- watching the worker's store ----------------------------------------------------------------------------


class Calls:
    """Records every call of one method of the worker's JobStore: its task, start, end and result. Optionally
    runs a one-shot hook first, or waits at a one-shot gate, so that a call can be made slow or put in flight
    at a chosen moment. It never changes what the real method does or returns."""

    def __init__(self, store: Any, name: str) -> None:
        self.name = name
        self.original = getattr(store, name)
        self.calls: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hook: Callable[[], Awaitable[None]] | None = None
        self.hook_skips = ""  # calls from tasks named with this prefix pass the hook by
        self.gate: asyncio.Event | None = None
        self.at_gate = asyncio.Event()
        self._gates: list[asyncio.Event] = []
        self._held: tuple[str, asyncio.Event] = ("", asyncio.Event())
        setattr(store, name, self._call)

    def hold_tasks(self, prefix: str) -> asyncio.Event:
        """Every call from a task whose name begins with `prefix` waits until the returned event is set, each try
        again too: a paused worker's lease keeper, whose renewals it abandons and tries again are held alike."""
        held = asyncio.Event()
        self._gates.append(held)
        self._held = (prefix, held)
        self.at_gate.clear()
        return held

    def arm_gate(self) -> asyncio.Event:
        gate = asyncio.Event()
        self._gates.append(gate)
        self.gate = gate
        self.at_gate.clear()
        return gate

    def open_all(self) -> None:
        for gate in self._gates:
            gate.set()

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        record: dict[str, Any] = {"args": args, "task": task.get_name() if task else "", "start": time.monotonic()}
        self.calls.append(record)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            hook = self.hook
            if hook is not None and not (self.hook_skips and record["task"].startswith(self.hook_skips)):
                self.hook = None
                await hook()
            prefix, held = self._held
            if not held.is_set() and prefix and record["task"].startswith(prefix):
                self.at_gate.set()
                await held.wait()
            gate, self.gate = self.gate, None
            if gate is not None:
                self.at_gate.set()
                await gate.wait()
            record["start_real"] = time.monotonic()
            result = await self.original(*args, **kwargs)
            record["result"] = result
            return result
        except BaseException as exc:
            record["error"] = exc
            raise
        finally:
            self.in_flight -= 1
            record["end"] = time.monotonic()

    def results(self, attempt_id: uuid.UUID | None = None) -> list[Any]:
        return [c.get("result", c.get("error")) for c in self.calls
                if attempt_id is None or attempt_id in c["args"]]


def watch(stack: AsyncExitStack, h: Harness, name: str) -> Calls:
    calls = Calls(h.activities.store, name)
    stack.callback(calls.open_all)
    return calls


async def pause_keeper(renewals: Calls) -> asyncio.Event:
    """The worker's lease keeper pauses: its scheduled renewals hang in flight (each one it abandons and tries
    again too) until the returned event is set; a step's own renewal is not held."""
    gate = renewals.hold_tasks("lease-")
    await asyncio.wait_for(renewals.at_gate.wait(), BOUND)
    assert renewals.calls[-1]["task"].startswith("lease-")
    return gate


def step_renewals(renewals: Calls, since: int, attempt_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
    """Renewals a step asked for itself, from call `since` on. The paused keeper's tries are left out: each one it
    abandons past its bound it tries again at once, so they may be recorded around a step's."""
    return [c for c in renewals.calls[since:] if not c["task"].startswith("lease-")
            and (attempt_id is None or attempt_id in c["args"])]


async def refused_once(cutoffs: Calls) -> None:
    await eventually(lambda: asyncio.sleep(0, [c for c in cutoffs.calls if "end" in c]), bool, timeout=BOUND,
                     what="cutoff 2 answered")


# --- reading Temporal's heartbeats, the worker's files and the outcome --------------------------------------


def refusals() -> dict[str, float]:
    """The in-process worker's cutoff 2 refusals so far, by reason (exports_cutoff_2_refused_total)."""
    return {reason: REGISTRY.get_sample_value("exports_cutoff_2_refused_total", {"reason": reason}) or 0.0
            for reason in ("late", "not_owner")}


async def heartbeat_progress(h: Harness, job_id: uuid.UUID, activity_type: str) -> dict[str, Any] | None:
    """The last heartbeat details Temporal holds for the workflow's pending activity of this type."""
    described = await h.client.get_workflow_handle(export_workflow_id(job_id)).describe()
    for pending in described.raw_description.pending_activities:
        if pending.activity_type.name == activity_type and pending.heartbeat_details.payloads:
            return json.loads(pending.heartbeat_details.payloads[0].data)
    return None


def local_files(h: Harness, job_id: uuid.UUID, attempt_id: uuid.UUID) -> list[Path]:
    return built_files(h.settings.work_dir, job_id, attempt_id)


async def assert_requeued_job_completes_under_a_new_attempt(h: Harness, job_id: uuid.UUID,
                                                            old: uuid.UUID) -> uuid.UUID:
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 2 and row.attempt_id != old
    found = await events(h.db, job_id)
    assert kinds(found, row.attempt_id)[:3] == ["Claimed", "BuildStarted", "DeliveryAuthorized"]
    assert kinds(found, row.attempt_id)[-1] == "Finished"
    assert_partner_holds(h.partner, row, only=True)
    delivers = [r for name, r in await history(h, job_id) if name == "deliver"]
    assert len(delivers) == 1 and delivers[0]["written"] is True  # the new attempt's, and only it
    return row.attempt_id


# --- LB: a long build ---------------------------------------------------------------------------------------------


@pytest.mark.spec("LB1")
async def test_long_build_keeps_renewing_and_heartbeating_and_delivers_once(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        # About 180 kB of contacts at 36 kB/s: a build of about five seconds against a lease of two.
        h = await lease_harness(stack, db, store, client, tmp_path, contacts=2000,
                                build_throttle_bytes_per_second=36_000)
        renewals = watch(stack, h, "renew_lease")
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)

        leases: list[Any] = []
        progress: list[int] = []
        recovery_report = None
        deadline = time.monotonic() + BOUND
        claimed_at = time.monotonic()
        while (state := await lease_state(db, job_id))["status"] == "Running":
            assert time.monotonic() < deadline, "the build did not end"
            if state["lease_expires_at"] is not None and state["lease_expires_at"] not in leases:
                leases.append(state["lease_expires_at"])
            beat = await heartbeat_progress(h, job_id, "build")
            if beat is not None and (not progress or beat["bytes"] > progress[-1]):
                progress.append(beat["bytes"])
            if recovery_report is None and time.monotonic() - claimed_at > LEASE * 1.5:
                # Past the initial lease: a recovery run now finds nothing to take over.
                recovery_report = await run_recovery(h.client, h.settings)
            await asyncio.sleep(0.15)

        row = await h.settled(job_id)
        found = await events(db, job_id)
        claimed = next(e["recorded_at"] for e in found if e["kind"] == "Claimed")
        authorized = next(e["recorded_at"] for e in found if e["kind"] == "DeliveryAuthorized")
        assert (authorized - claimed).total_seconds() > LEASE * 1.5, "the build did not outlast its lease"
        # The lease moved forward again and again while building, and the activity heartbeat its progress.
        assert len(leases) >= 5 and leases == sorted(leases), leases
        assert (leases[-1] - leases[0]).total_seconds() > LEASE
        assert len(progress) >= 3, progress
        scheduled = [c for c in renewals.calls if c["task"].startswith("lease-")]
        assert len(scheduled) >= 5 and all(c["result"] is True for c in scheduled)
        assert recovery_report is not None
        assert [t for t in recovery_report.taken_over if t.job_id == job_id] == []
        assert_delivered_once_by(h, row, attempt_id, found)
        assert [name for name, _ in await history(h, job_id)].count("deliver") == 1
        assert [name for name, _ in await history(h, job_id)].count("build") == 1  # never resumed elsewhere


def assert_delivered_once_by(h, row, attempt_id, found) -> None:
    """Completed by this one attempt: authorized and finished once, never taken over, its file alone at the
    partner."""
    assert row.status is Status.COMPLETED and row.attempt_count == 1 and row.attempt_id == attempt_id
    assert kinds(found).count("DeliveryAuthorized") == 1 and kinds(found).count("Finished") == 1
    assert not {"RequeuedByRecovery", "ResolvedByRecovery"} & set(kinds(found))
    assert_partner_holds(h.partner, row, only=True)


@pytest.mark.spec("LB2")
async def test_attempt_paused_past_its_lease_is_refused_at_cutoff_2_renews_and_delivers(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        hold = Hold(BEFORE_CUTOFF_2)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold)
        cutoffs = watch(stack, h, "authorize_delivery")
        renewals = watch(stack, h, "renew_lease")
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()
        paused = await pause_keeper(renewals)
        await wait_expired(db, job_id)
        # Paused past its lease, and nobody took over: the row is still this attempt's, Running, expired.
        state = await lease_state(db, job_id)
        assert (state["status"], state["attempt_id"], state["expired"]) == ("Running", attempt_id, True)
        renewals_before = len(renewals.calls)
        hold.release.set()
        await refused_once(cutoffs)  # its renewal now waits behind the paused keeper's
        paused.set()

        row = await h.settled(job_id)
        # Refused once for the lapsed lease, renewed (no takeover had committed), then authorized.
        assert cutoffs.results(attempt_id) == [AuthorizationResult.LEASE_LAPSED, AuthorizationResult.AUTHORIZED]
        own = step_renewals(renewals, renewals_before)
        assert own and own[0]["result"] is True
        assert cutoffs.calls[0]["end"] <= own[0]["start"] and own[0]["end"] <= cutoffs.calls[1]["start"]
        assert_delivered_once_by(h, row, attempt_id, await events(db, job_id))


@pytest.mark.spec("LB3")
async def test_after_a_takeover_the_paused_attempts_renewal_changes_nothing_and_it_stops(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        hold = Hold(BEFORE_CUTOFF_2)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold)
        cutoffs = watch(stack, h, "authorize_delivery")
        renewals = watch(stack, h, "renew_lease")
        job_id = await h.create()
        old = await first_attempt(db, job_id)
        await hold.wait_held()
        gate = await pause_keeper(renewals)
        await wait_expired(db, job_id)
        # Released: cutoff 2 refuses the lapsed lease; its renewal waits behind the paused keeper's, and
        # recovery's takeover commits before either reaches the database.
        renewals_before = len(renewals.calls)
        hold.release.set()
        await refused_once(cutoffs)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        taken_over_at = next(e["recorded_at"] for e in await events(db, job_id) if e["kind"] == "RequeuedByRecovery")
        gate.set()

        new = await assert_requeued_job_completes_under_a_new_attempt(h, job_id, old)
        # The renewal changed nothing, and the attempt stopped there: no second cutoff, nothing written.
        assert [c["result"] for c in step_renewals(renewals, renewals_before, old)] == [False]
        assert not [c for c in renewals.calls[renewals_before:] if old in c["args"] and c.get("result") is True]
        assert cutoffs.results(old) == [AuthorizationResult.LEASE_LAPSED]
        found = await events(db, job_id)
        assert kinds(found, old) == ["Claimed", "BuildStarted", "RequeuedByRecovery"]
        assert all(e["attempt_id"] == new for e in found if e["recorded_at"] > taken_over_at)
        assert not local_files(h, job_id, old)
        names = [name for name, _ in await history(h, job_id)]
        assert names.count("authorize_delivery") == 2 and names.count("deliver") == 1  # the old one never sent


# --- LU: a long upload --------------------------------------------------------------------------------------------


@pytest.mark.spec("LU1")
async def test_long_upload_keeps_its_lease_and_completes_not_taken_over(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await lease_harness(stack, db, store, client, tmp_path, contacts=2000,
                                upload_throttle_bytes_per_second=36_000)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await wait_status(h, job_id, Status.DELIVERING)
        delivering_since = time.monotonic()
        leases: list[Any] = []
        sent: list[int] = []
        report = None
        deadline = time.monotonic() + BOUND
        while (state := await lease_state(db, job_id))["status"] == "Delivering":
            assert time.monotonic() < deadline, "the upload did not end"
            if state["lease_expires_at"] is not None and state["lease_expires_at"] not in leases:
                leases.append(state["lease_expires_at"])
            beat = await heartbeat_progress(h, job_id, "deliver")
            if beat is not None and (not sent or beat["sent"] > sent[-1]):
                sent.append(beat["sent"])
            if report is None and time.monotonic() - delivering_since > LEASE * 1.5:
                report = await run_recovery(h.client, h.settings)  # during the upload, past the initial lease
            await asyncio.sleep(0.15)

        row = await h.settled(job_id)
        found = await events(db, job_id)
        authorized = next(e["recorded_at"] for e in found if e["kind"] == "DeliveryAuthorized")
        finished = next(e["recorded_at"] for e in found if e["kind"] == "Finished")
        assert (finished - authorized).total_seconds() > LEASE * 1.5, "the upload did not outlast its lease"
        assert len(leases) >= 5 and leases == sorted(leases), leases
        assert len(sent) >= 3, sent
        assert report is not None and [t for t in report.taken_over if t.job_id == job_id] == []
        assert row.status is Status.COMPLETED and row.attempt_id == attempt_id and row.attempt_count == 1
        assert [e["attempt_id"] for e in found if e["kind"] == "Finished"] == [attempt_id]
        assert "ResolvedByRecovery" not in kinds(found)
        assert_partner_holds(h.partner, row, only=True)


@pytest.mark.spec("LU2")
async def test_take_back_during_upload__the_upload_finishes_never_renames_and_the_next_attempt_delivers(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, contacts=2000,
                        upload_throttle_bytes_per_second=30_000)
        blocker = RenewalBlocker(proxy)
        stack.push_async_callback(blocker.stop)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await wait_status(h, job_id, Status.DELIVERING)
        await eventually(lambda: heartbeat_progress(h, job_id, "deliver"), lambda b: bool(b and b["sent"]),
                         timeout=BOUND, what="the upload under way")
        # The worker can no longer renew: its lease runs out in the middle of the upload.
        blocker.start()
        await wait_expired(db, job_id)
        report = await run_recovery(h.client, h.settings)
        # Mid-upload, before its rename fence: recovery takes the attempt back rather than call it unknown.
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        blocker_cuts = blocker.cuts
        await blocker.stop()
        requeued = next(e for e in await events(db, job_id) if e["kind"] == "RequeuedByRecovery")

        row = await h.settled(job_id)  # the old upload is not stopped; a new attempt delivers
        assert blocker_cuts >= 1
        assert row.status is Status.COMPLETED and row.attempt_id != attempt_id
        delivers = [r for name, r in await history(h, job_id) if name == "deliver"]
        assert len(delivers) == 2 and delivers[0]["written"] is False  # the old attempt's write matched nothing
        found = await events(db, job_id)
        old_evidence = [json.loads(e["detail"]) for e in found if e["kind"] == "DeliveryEvidence"
                        and e["attempt_id"] == attempt_id and e["recorded_at"] > requeued["recorded_at"]]
        steps = [d["step"] for d in old_evidence]
        # The old upload finished its bytes, was refused at its fence, appended that, and never renamed.
        assert "fresh_listing" in steps and "rename" not in steps and "receipt" not in steps, steps
        failure = next(d for d in old_evidence if d["step"] == "fresh_listing")
        assert failure["failed_step"] == "upload" and "rename fence refused" in failure["error"], failure
        assert kinds(found, attempt_id)[:4] == ["Claimed", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence"]
        assert "Finished" not in kinds(found, attempt_id) and "ResolvedByRecovery" not in kinds(found)
        assert_partner_holds(h.partner, row, only=True)
        assert list((h.partner.root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("LU2", "PA1")
async def test_takeover_before_the_terminal_write__recovery_resolves_from_the_receipt_and_the_write_matches_nothing(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(AFTER_RECEIPT)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold)
        finishes = watch(stack, h, "finish_delivery")
        blocker = RenewalBlocker(proxy)
        stack.push_async_callback(blocker.stop)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()  # the partner confirmed the file; the keeper still renews
        blocker.start()
        await wait_expired(db, job_id)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["ResolvedByRecovery"]
        await blocker.stop()
        taken = await events(db, job_id)
        resolved = next(e for e in taken if e["kind"] == "ResolvedByRecovery")
        assert resolved["detail"].startswith("Completed: receipt appended by the attempt")
        hold.release.set()

        row = await h.settled(job_id)
        assert finishes.results(attempt_id) == [False]  # the completion write matched nothing
        found = await events(db, job_id)
        assert found[: len(taken)] == taken
        assert found[len(taken):] == []  # nothing at all was written after the takeover
        assert "Finished" not in kinds(found)
        assert row.status is Status.COMPLETED and row.attempt_id == attempt_id and row.lease_expires_at is None
        delivers = [r for name, r in await history(h, job_id) if name == "deliver"]
        assert len(delivers) == 1 and delivers[0]["written"] is False
        assert_partner_holds(h.partner, row, only=True)


# --- PA: a paused attempt after a takeover -----------------------------------------------------------------------


@pytest.mark.spec("PA1", "LB3")
async def test_paused_attempt_after_takeover__its_authorization_matches_nothing_and_records_nothing(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        hold = Hold(BEFORE_CUTOFF_2)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold)
        cutoffs = watch(stack, h, "authorize_delivery")
        renewals = watch(stack, h, "renew_lease")
        stops = watch(stack, h, "finish_stopped")
        failures = watch(stack, h, "finish_failed")
        job_id = await h.create()
        old = await first_attempt(db, job_id)
        await hold.wait_held()
        paused = await pause_keeper(renewals)
        await wait_expired(db, job_id)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        taken = await events(db, job_id)
        refused_before = refusals()
        renewals_before = len(renewals.calls)
        paused.set()  # the keeper's renewal in flight changes nothing, and the keeper stops
        hold.release.set()

        await assert_requeued_job_completes_under_a_new_attempt(h, job_id, old)
        assert cutoffs.results(old) == [AuthorizationResult.NOT_OWNER]
        assert refusals() == {"late": refused_before["late"], "not_owner": refused_before["not_owner"] + 1}
        assert not step_renewals(renewals, renewals_before, old)  # not the owner: no renewal
        assert not [c for c in renewals.calls[renewals_before:] if old in c["args"] and c.get("result") is True]
        assert stops.results(old) == [] and failures.results(old) == []
        found = await events(db, job_id)
        assert found[: len(taken)] == taken and kinds(found, old) == ["Claimed", "BuildStarted",
                                                                      "RequeuedByRecovery"]
        assert not local_files(h, job_id, old)


@pytest.mark.spec("PA1")
async def test_paused_build_after_takeover__its_error_path_records_nothing(db, store, client, tmp_path, caplog):
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(BUILD_STARTED)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold)
        renewals = watch(stack, h, "renew_lease")
        stops = watch(stack, h, "finish_stopped")
        failures = watch(stack, h, "finish_failed")
        blocker = RenewalBlocker(proxy)
        stack.push_async_callback(blocker.stop)
        job_id = await h.create()
        old = await first_attempt(db, job_id)
        await hold.wait_held()  # the build renewed and started; its worker is paused here
        blocker.start()
        await wait_expired(db, job_id)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        taken = await events(db, job_id)
        with caplog.at_level(logging.WARNING, logger="activities.lease"):
            # No renewal answered: the keeper, on its own clock, stopped the build before its lease lapsed (PT2),
            # so the takeover found it already ended; the network comes back.
            await blocker.stop()
            await assert_requeued_job_completes_under_a_new_attempt(h, job_id, old)
        assert any("lease lapses within" in r.getMessage() and str(old) in r.getMessage() for r in caplog.records)
        builds = [r for name, r in await history(h, job_id) if name == "build"]
        assert builds[0]["ended"] == "LeaseLapsing"
        assert not any(r is False for r in renewals.results(old))  # none ever told it of the takeover
        assert stops.results(old) == [] and failures.results(old) == []
        found = await events(db, job_id)
        assert found[: len(taken)] == taken and kinds(found, old) == ["Claimed", "BuildStarted",
                                                                      "RequeuedByRecovery"]
        assert not local_files(h, job_id, old)


# --- RN: renewal ----------------------------------------------------------------------------------------------------


@pytest.mark.spec("RN1")
async def test_renewal_that_throws_does_not_stop_a_healthy_build(db, store, client, tmp_path, caplog):
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, contacts=2000,
                        build_throttle_bytes_per_second=40_000)
        renewals = watch(stack, h, "renew_lease")
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        scheduled = lambda: [c for c in renewals.calls if c["task"].startswith("lease-") and "end" in c]  # noqa: E731
        await eventually(lambda: asyncio.sleep(0, scheduled()), lambda cs: len(cs) >= 1, timeout=BOUND,
                         what="a scheduled renewal")
        with caplog.at_level(logging.WARNING, logger="activities.lease"):
            cut = proxy.cut_before(RENEWAL)
            await asyncio.wait_for(cut.wait(), BOUND)
            assert (await lease_state(db, job_id))["status"] == "Running"  # it threw in the middle of the build
            thrown = await eventually(lambda: asyncio.sleep(0, [c for c in scheduled() if "error" in c]), bool,
                                      timeout=BOUND, what="the renewal that threw")
            row = await h.settled(job_id)
        assert len(thrown) == 1
        after = [c for c in scheduled() if c["start"] > thrown[0]["end"]]
        assert after and after[0]["result"] is True  # retried at the next interval, and renewed
        assert any("lease renewal" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
        assert not any("lost ownership" in r.getMessage() for r in caplog.records)
        assert row.status is Status.COMPLETED and row.attempt_count == 1 and row.attempt_id == attempt_id
        found = await events(db, job_id)
        assert kinds(found).count("Finished") == 1 and "RequeuedByRecovery" not in kinds(found)
        assert [name for name, _ in await history(h, job_id)].count("build") == 1
        assert_partner_holds(h.partner, row, only=True)


@pytest.mark.spec("RN2")
async def test_on_demand_renewal_overlapping_a_scheduled_one_is_serialized(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await lease_harness(stack, db, store, client, tmp_path, lease_seconds=4.0, renew_every_seconds=0.2)
        renewals = watch(stack, h, "renew_lease")
        locker = await db.connect("owner")
        stack.push_async_callback(locker.close)
        locked = asyncio.Event()
        job_id_box: dict[str, uuid.UUID] = {}

        async def lock_the_row() -> None:
            # The build's on-demand renewal (its first statement) meets a row lock held elsewhere: it is slow, and
            # the keeper's scheduled renewals come due while it is in flight.
            await locker.execute("BEGIN")
            await locker.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE", job_id_box["id"])
            locked.set()

        renewals.hook = lock_the_row
        renewals.hook_skips = "lease-"  # a scheduled renewal that comes first passes; the build's is the slow one
        job_id = await h.create()
        job_id_box["id"] = job_id
        await asyncio.wait_for(locked.wait(), BOUND)
        waiting: list[int] = []
        window_end = time.monotonic() + 1.2  # six renewal intervals
        while time.monotonic() < window_end:
            waiting.append(await db.admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = 'exports_app' AND state = 'active' "
                "AND query LIKE '%SET lease_expires_at%'"))
            await asyncio.sleep(0.05)
        in_flight_during_window = renewals.max_in_flight
        await locker.execute("ROLLBACK")
        row = await h.settled(job_id)

        assert max(waiting) == 1 and min(waiting[5:]) == 1, waiting  # one renewal at the database, never two
        assert in_flight_during_window == 1
        first_on_demand = next(i for i, c in enumerate(renewals.calls) if not c["task"].startswith("lease-"))
        on_demand, scheduled = renewals.calls[first_on_demand], renewals.calls[first_on_demand + 1]
        assert scheduled["task"].startswith("lease-")
        assert on_demand["result"] is True and scheduled["result"] is True
        # The scheduled renewal was due within 0.2 s but started only after the on-demand one had finished.
        assert scheduled["start"] >= on_demand["end"] and on_demand["end"] - on_demand["start"] >= 1.0
        assert renewals.max_in_flight == 1
        assert all(b["start"] >= a["end"] for a, b in itertools.pairwise(renewals.calls))
        assert row.status is Status.COMPLETED and row.attempt_count == 1


@pytest.mark.spec("RN3")
async def test_renewals_stop_after_the_terminal_write_and_a_late_one_is_not_a_loss(db, store, client, tmp_path,
                                                                                   caplog):
    async with AsyncExitStack() as stack:
        hold = Hold(AFTER_RECEIPT)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold, renew_every_seconds=0.2)
        renewals = watch(stack, h, "renew_lease")
        finishes = watch(stack, h, "finish_delivery")
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()
        with caplog.at_level(logging.WARNING, logger="activities.lease"):
            # A scheduled renewal goes in flight and stays there across the terminal write.
            gate = renewals.arm_gate()
            await asyncio.wait_for(renewals.at_gate.wait(), BOUND)
            late = renewals.calls[-1]
            assert late["task"].startswith("lease-")
            hold.release.set()
            await eventually(lambda: asyncio.sleep(0, finishes.calls), lambda cs: bool(cs) and "end" in cs[0],
                             timeout=BOUND, what="the terminal write")
            assert finishes.calls[0]["result"] is True
            assert (await lease_state(db, job_id))["status"] == "Completed"
            await asyncio.sleep(0.1)  # the activity is now in the keeper's finish(), waiting for the renewal
            gate.set()
            row = await h.settled(job_id)
            calls_at_end = len(renewals.calls)
            # Renewals have stopped: none in five more intervals.
            quiet_until = time.monotonic() + 1.0
            while time.monotonic() < quiet_until:
                assert len(renewals.calls) == calls_at_end
                await asyncio.sleep(0.05)
        assert late["result"] is False and late["start_real"] > finishes.calls[0]["end"]  # it found no row
        assert not any("lost ownership" in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records]
        assert all(c["start"] < finishes.calls[0]["end"] for c in renewals.calls)
        delivers = [r for name, r in await history(h, job_id) if name == "deliver"]
        assert len(delivers) == 1 and delivers[0]["written"] is True
        assert row.status is Status.COMPLETED and row.attempt_id == attempt_id and row.lease_expires_at is None
        assert [e["attempt_id"] for e in await events(db, job_id) if e["kind"] == "Finished"] == [attempt_id]

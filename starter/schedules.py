"""The Temporal Schedules that run recovery, the sweeper, the sweep of partners' temporary files and the evidence
follow-up. Installing
them again updates them in place."""

from __future__ import annotations

from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import FollowUpInput, RecoveryInput, SweepInput
from store.settings import Settings

RECOVERY_SCHEDULE = "exports-recovery"
SWEEPER_SCHEDULE = "exports-sweeper"
PARTNER_SWEEP_SCHEDULE = "exports-partner-sweep"
FOLLOW_UP_SCHEDULE = "exports-follow-up"


def schedules(settings: Settings) -> dict[str, Schedule]:
    def every(seconds: float, workflow: str, arg: object, workflow_id: str) -> Schedule:
        return Schedule(
            action=ScheduleActionStartWorkflow(workflow, args=[] if arg is None else [arg], id=workflow_id,
                                               task_queue=settings.task_queue),
            spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=timedelta(seconds=seconds))]),
            # Never two at once: a run still going when the next is due makes that one skip.
            policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
        )

    return {
        RECOVERY_SCHEDULE: every(settings.recovery_interval_seconds, "RecoveryWorkflow",
                                 RecoveryInput(limit=settings.recovery_batch), "exports-recovery-run"),
        SWEEPER_SCHEDULE: every(settings.sweeper_interval_seconds, "SweeperWorkflow",
                                SweepInput(threshold_seconds=settings.sweeper_threshold_seconds,
                                           batch=settings.sweeper_batch), "exports-sweeper-run"),
        PARTNER_SWEEP_SCHEDULE: every(settings.partner_sweep_interval_seconds, "PartnerSweepWorkflow", None,
                                      "exports-partner-sweep-run"),
        FOLLOW_UP_SCHEDULE: every(settings.follow_up_interval_seconds, "EvidenceFollowUpWorkflow",
                                  FollowUpInput(limit=settings.follow_up_batch,
                                                window_seconds=settings.follow_up_window_seconds),
                                  "exports-follow-up-run"),
    }


async def install_schedules(client: Client, settings: Settings) -> dict[str, str]:
    """Create each schedule, or update it to the current settings if it exists. Returns what was done."""
    done = {}
    for schedule_id, schedule in schedules(settings).items():
        try:
            await client.create_schedule(schedule_id, schedule)
            done[schedule_id] = "created"
        except ScheduleAlreadyRunningError:
            def replace(_: ScheduleUpdateInput, schedule: Schedule = schedule) -> ScheduleUpdate:
                return ScheduleUpdate(schedule=schedule)

            await client.get_schedule_handle(schedule_id).update(replace)
            done[schedule_id] = "updated"
    return done


async def remove_schedules(client: Client, schedule_ids: list[str]) -> dict[str, str]:
    """Delete each schedule, and terminate the run it has open (a rollback to a release that does not know its
    workflow). A schedule that is not there is reported, not an error. Returns what was done."""
    done = {}
    for schedule_id in schedule_ids:
        handle = client.get_schedule_handle(schedule_id)
        try:
            running = [action.workflow_id for action in (await handle.describe()).info.running_actions
                       if isinstance(action, ScheduleActionExecutionStartWorkflow)]
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
            done[schedule_id] = "not installed"
            continue
        await handle.delete()
        for workflow_id in running:
            try:
                await client.get_workflow_handle(workflow_id).terminate(reason=f"schedule {schedule_id} removed")
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
        done[schedule_id] = "removed" + (f", its open run terminated ({', '.join(running)})" if running else "")
    return done

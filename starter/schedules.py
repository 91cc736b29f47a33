"""The Temporal Schedules that run recovery, the sweeper and the sweep of partners' temporary files. Installing
them again updates them in place."""

from __future__ import annotations

from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
)

from activities.contracts import RecoveryInput, SweepInput
from store.settings import Settings

RECOVERY_SCHEDULE = "exports-recovery"
SWEEPER_SCHEDULE = "exports-sweeper"
PARTNER_SWEEP_SCHEDULE = "exports-partner-sweep"


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

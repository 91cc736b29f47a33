"""Every patch the workflows branch on, and which of them this release activates.

A patch (`workflow.patched(ID)`) keeps the commands that runs recorded before a change. A run that replays takes
the branch its history recorded: the new one where it has the patch's marker, the old one where it has none. A run
that reaches the call live takes the new branch, and records the marker, only if the worker activates the patch
(the SDK's patch_activation_callback, `activates` below); otherwise it takes the old branch and records nothing.

The rule that makes a rollback by one release safe: a release ships a new patch inactive (listed in UNDERSTOOD),
so that it replays runs whose history has the marker but writes none; the next release activates it (moves it to
ACTIVE). Rolled back from that next release, this one still replays every run the next one touched. A patch is
retired as docs/changing-workflows.md says: `workflow.deprecate_patch`, then removal, each a release of its own.

0.2.0 is the first release under this rule. The patches below were all written first by 0.2.0, unannounced by
0.1.0, which therefore cannot replay runs that 0.2.0 touched: a rollback to 0.1.0 drains first (CHANGELOG.md).
"""

from __future__ import annotations

from collections.abc import Callable

from temporalio.worker import PatchActivationInput

# Export runs started before the delivery returned its row replay the re-read they recorded.
ROW_FROM_DELIVERY = "row-from-delivery"
# Export runs started before a late wake-up was read again replay their return as recorded.
WAKE_AFTER_SETTLED = "wake-after-settled"
# Export runs started before policy and the claim became one step (0.1.0's) replay them as two, and show only the
# states they read from the row, as 0.1.0 did (no Running at the claim, no Delivering at cutoff 2).
POLICY_AND_CLAIM = "policy-and-claim"
# Export runs whose cancellation found the row locked before Busy requests were asked again (0.1.0's) replay no
# retry.
BUSY_CANCEL_RETRY = "busy-cancel-retry"
# Recovery runs started before recovery drained its backlog in rounds replay the single batch they recorded.
RECOVERY_ROUNDS = "recovery-rounds"
# Export runs that recorded this accept the `cancel` Update (0.3.0 ships it understood; a release that does not
# know the Update could not replay a run that accepted one).
CANCEL_UPDATE = "cancel-update"

# Export runs that recorded this stopped waiting for their claim (on the admission queue, for a build slot) once a
# recorded cancellation had left the row Canceled, and read the row at once; and asked Temporal's cancel for the
# start's tenant before the row was read (0.3.0 ships it understood).
CANCELED_WHILE_CLAIMING = "canceled-while-claiming"

# Export runs that recorded this ask Temporal's cancel again, backing off, while the row stays locked (Busy), until
# a request of it is recorded: the server takes one cancel of a run, so the UI's Cancel cannot be sent again. Runs
# without it gave it up after the few tries any Busy request gets (0.3.0 ships it understood).
TEMPORAL_CANCEL_UNTIL_RECORDED = "temporal-cancel-until-recorded"

# Export runs that recorded this ask a cancel signal sent again, after its Busy tries were spent, as a new request,
# with all its tries. Runs without it gave the signal sent again one try (0.3.0 ships it understood).
BUSY_SIGNAL_SENT_AGAIN = "busy-signal-sent-again"

# Export runs that recorded this wait a moment (a timer) before they continue as new, and check again: Temporal's
# cancel that reached the run in one workflow task with signals was applied after the first check, and lost with
# the run. Only runs that accept the cancel Update continue as new (0.3.0 ships it understood, and activates it
# early with CANCEL_UPDATE).
CANCEL_BEFORE_CONTINUING_AS_NEW = "cancel-before-continuing-as-new"
# Export runs that recorded this pause before continuing as new once only, and wait out what is left of the idle
# recheck, not all of it again, after a pause that ended with work in flight. Runs with the pause alone paused at
# every chance: a trickle of cancels, one in flight at the end of each pause, kept the run from ever continuing as
# new until the server's cap on its history ended it, and kept its row from being read again (0.3.0 ships it
# understood, and activates it early with CANCEL_UPDATE).
PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW = "pause-once-before-continuing-as-new"

# Written on new runs by this release.
ACTIVE = frozenset({ROW_FROM_DELIVERY, WAKE_AFTER_SETTLED, POLICY_AND_CLAIM, BUSY_CANCEL_RETRY, RECOVERY_ROUNDS})
# Replayed where a history recorded them, never written: the next release activates them.
UNDERSTOOD: frozenset[str] = frozenset({CANCEL_UPDATE, CANCELED_WHILE_CLAIMING, TEMPORAL_CANCEL_UNTIL_RECORDED,
                                        BUSY_SIGNAL_SENT_AGAIN, CANCEL_BEFORE_CONTINUING_AS_NEW,
                                        PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW})


def activates(request: PatchActivationInput) -> bool:
    """The worker's patch_activation_callback: whether a run that reaches `patched(ID)` live takes the new branch.
    A patch this release does not list is never activated."""
    return request.patch_id in ACTIVE


# Patches whose branch only runs that took another patch's branch reach: activated early with that one, since
# they add no run that a rollback must drain first.
_WITHIN = {CANCEL_UPDATE: frozenset({CANCEL_BEFORE_CONTINUING_AS_NEW, PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW})}


def activation(early: frozenset[str] = frozenset()) -> Callable[[PatchActivationInput], bool]:
    """`activates`, and also the patches of UNDERSTOOD an operator chose to activate early (EXPORTS_EARLY_PATCHES),
    accepting that a rollback to the previous release drains the runs that recorded them first, with the patches
    within them."""
    chosen = early & UNDERSTOOD
    chosen |= {within for patch in chosen for within in _WITHIN.get(patch, ())}

    def activates_early(request: PatchActivationInput) -> bool:
        return activates(request) or request.patch_id in chosen

    return activates_early

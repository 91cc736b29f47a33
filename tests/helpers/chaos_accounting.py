"""The chaos run's accounting of outcomes that need a person (case LV8), and of the faults that caused them.

An outcome needs a person when nobody asked for it and it delivered nothing for sure: OutcomeUnknown, and Failed for
any reason but OriginalDelivered (a replacement that found its original's file: delivered). Seen in chaos runs:
NotDelivered, AttemptsExhausted, BuildFailed (a database cut mid-build) and FinalNameOccupied (below). Stopped,
Canceled and Rejected are what an operator asked for.
It is the outcome the system itself recorded for the export's last attempt (the worker's `Finished` or `Failed`, or
recovery's `ResolvedByRecovery` or `AttemptsExhausted`), not what an operator made of it later: an OutcomeUnknown
an operator reconciled still needed that operator.

Attribution. The harness records each fault it injects (`Fault`; the kills that leave one worker to settle too):
its class (as `Chaos.injected` counts it), its time window on the wall clock (an instant for a kill or a cut,
SIGSTOP to SIGCONT for a pause, stop to start for a Temporal restart) and its scope: a worker fault touches one
worker process (its pid); a database cut (every worker's PostgreSQL connections go through the proxy), a partner
cut (every SFTP connection is closed) and a Temporal restart touch every export. An operator-needed outcome is
attributed to every fault that

- overlaps its last attempt's window, from the attempt's `Claimed` to its terminal event (the database's clock,
  which is this machine's), widened by `MARGIN` seconds on each side; partner faults count only from the
  attempt's `DeliveryAuthorized` on (no SFTP connection is opened before it);
- touches it: a worker fault only if the attempt was claimed by that process (the pid is in the worker ID,
  `<host>-<pid>-<hex>`); global faults always;
- can cause what was recorded (`CAN_CAUSE`): an outcome the worker wrote itself after its delivery (`Finished`)
  reports what happened at the partner, so only a partner cut explains it: the delivery waits out a database
  outage and a Temporal restart, and a worker killed or paused past its lease never writes `Finished` (recovery
  resolves the attempt first). Every other terminal (recovery's, a failed build's) can come from any class.

A replacement that found its final name occupied (Failed/FinalNameOccupied) met its original's file, delivered
late by an attempt whose outcome was unknown: it is attributed to what made its original need a person.

Its cause, for the report by class, is the most specific of those: a fault within the attempt's window (not only
within its margin) first; then the first fault of its own worker (a pause, then a kill while paused: the pause),
else the latest partner cut, database cut or Temporal restart, in that order. An outcome with no such fault is
unattributed: the run fails on it, since the faults the run injected do not explain it.

Confirmations. An export is confirmed when the system itself recorded Completed for it (a worker's receipt, or
recovery's look at the partner), not an operator's reconciliation. Among the exports that were to deliver (all
but Canceled, Stopped, Rejected and Failed/OriginalDelivered), the run fails when fewer than its profile's floor
were confirmed: confirmations that never happen (every delivery OutcomeUnknown) are the failure that matters most,
and an operator can reconcile the files by hand only so far.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from store.recovery import LOST_AMID_OTHERS

MARGIN = 1.0  # seconds either side of an attempt's window: recording order and the moment a fault takes effect

# Fault classes, most specific first: the order in which a cause is chosen among several.
WORKER_FAULTS = ("worker crash", "worker pause")
GLOBAL_FAULTS = ("partner cut", "database cut", "Temporal restart")
PRIORITY = WORKER_FAULTS + GLOBAL_FAULTS
PARTNER_FAULTS = frozenset({"partner cut"})

# Which fault classes can cause an outcome recorded by a terminal event of this kind; a kind not listed: any.
CAN_CAUSE: dict[str, frozenset[str]] = {
    "Finished": PARTNER_FAULTS,
}

# Outcomes an operator asked for, or that delivered (a replacement that found its original's file).
NOT_TO_DELIVER = frozenset({"Canceled", "Stopped", "Rejected", "Failed/OriginalDelivered"})
TERMINALS = ("Finished", "ResolvedByRecovery", "Failed", "AttemptsExhausted", "Stopped", "StoppedByRecovery",
             "RequeuedByRecovery")
_PID = re.compile(r"-(\d+)-[0-9a-f]+$")


def worker_pid(worker_id: str | None) -> int | None:
    """The process ID in a worker ID (`<host>-<pid>-<hex>`, see worker.new_worker_id), or in a row's `claimed_by`
    (the worker ID, then `/<build holder>` once its build started); None if there is none."""
    found = _PID.search((worker_id or "").split("/", 1)[0])
    return int(found.group(1)) if found else None


@dataclass
class Fault:
    """One injected fault: its class, its window on the wall clock (time.time(); `end` None while it lasts) and
    its scope (`pid`: one worker process; None: every export)."""

    kind: str
    start: float
    end: float | None = None
    pid: int | None = None
    detail: str = ""

    def until(self, now: float) -> float:
        return now if self.end is None else self.end

    def describe(self, t0: float) -> str:
        span = f"{self.start - t0:.1f}s" + ("" if self.end == self.start else
                                             f"-{'…' if self.end is None else f'{self.end - t0:.1f}s'}")
        return f"{self.kind} at {span}" + (f" pid {self.pid}" if self.pid else "") + (
            f" ({self.detail})" if self.detail else "")


def _epoch(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(value)


def _prefix(detail: str | None) -> str:
    return (detail or "").split(":", 1)[0].strip()


@dataclass(frozen=True)
class Recorded:
    """What the system recorded for an export's last attempt."""

    outcome: str  # "Completed", "OutcomeUnknown", "Failed/<reason>", "Stopped", "Canceled", ...
    terminal: str | None  # the event that recorded it; None for an export without an attempt
    attempt_id: uuid.UUID | None = None
    pid: int | None = None  # the worker that claimed the attempt
    claimed: float | None = None
    authorized: float | None = None
    ended: float | None = None
    renamed: bool = False  # the attempt passed its rename fence: its rename may have been sent
    replacement: bool = False  # a replacement's attempt
    # The export's earlier attempts taken back by recovery, by how they were lost, and handed back by their worker.
    lost_alone: int = 0
    lost_with_worker: int = 0
    lost_amid_others: int = 0
    handed_back: int = 0
    error: str = ""  # the last error the attempt's evidence recorded (where the delivery failed, and how)

    @property
    def losses(self) -> str:
        if not (self.lost_alone or self.lost_with_worker or self.lost_amid_others or self.handed_back):
            return ""
        return (f"; before it {self.lost_alone} lost alone, {self.lost_with_worker} lost with their worker, "
                f"{self.lost_amid_others} amid other workers' losses, {self.handed_back} handed back")


def _evidence(detail: str | None) -> dict[str, Any]:
    try:
        value = json.loads(detail or "")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def evidence_step(detail: str | None) -> object:
    """The `step` of an evidence record's detail, None where it has none."""
    return _evidence(detail).get("step")


def last_error(events: list[dict[str, Any]]) -> str:
    """The last error an attempt's evidence records (its events), with the step that met it; "" if none."""
    for e in reversed(events):
        record = _evidence(e.get("detail")) if e["kind"] == "DeliveryEvidence" else {}
        if record.get("error"):
            return f"{record.get('failed_step', record.get('step'))}: {record['error']}"
    return ""


def recorded_outcome(row: dict[str, Any], events: list[dict[str, Any]]) -> Recorded:
    """The outcome the worker or recovery recorded for the row's attempt (its events: kind, attempt_id, worker_id,
    detail, recorded_at), before any operator reconciled or corrected it."""
    attempt = row.get("attempt_id")
    status = str(row["status"])
    reason = row.get("failure_reason")
    replacement = row.get("replaces_job_id") is not None
    if attempt is None:
        return Recorded(status, None, replacement=replacement)
    mine = [e for e in events if e["attempt_id"] == attempt]
    claimed = next((e for e in mine if e["kind"] == "Claimed"), None)
    authorized = next((e for e in mine if e["kind"] == "DeliveryAuthorized"), None)
    terminal = next((e for e in mine if e["kind"] in TERMINALS), None)
    operated = any(e["kind"] in ("Reconciled", "Corrected") for e in mine)
    if terminal is None:
        outcome, kind = status + (f"/{reason}" if reason else ""), None
    elif terminal["kind"] in ("Finished", "ResolvedByRecovery"):
        outcome, kind = _prefix(terminal["detail"]), terminal["kind"]
        if outcome == "Failed":
            outcome += f"/{reason}" if reason and not operated else "/?"  # corrected since: its reason is gone
    elif terminal["kind"] == "Failed":
        outcome, kind = f"Failed/{_prefix(terminal['detail']) or reason}", "Failed"
    elif terminal["kind"] == "AttemptsExhausted":
        outcome, kind = "Failed/AttemptsExhausted", "AttemptsExhausted"
    elif terminal["kind"] == "RequeuedByRecovery":
        outcome, kind = status, None  # requeued, then canceled while queued
    else:
        outcome, kind = "Stopped", terminal["kind"]
    renamed = any(e["kind"] == "DeliveryEvidence" and evidence_step(e.get("detail")) == "rename" for e in mine)
    taken_back = [e.get("detail") for e in events if e["kind"] == "RequeuedByRecovery"]
    return Recorded(
        outcome=outcome, terminal=kind, attempt_id=attempt, renamed=renamed, replacement=replacement,
        lost_alone=taken_back.count("lost alone"), lost_with_worker=taken_back.count("lost with its worker"),
        lost_amid_others=taken_back.count(LOST_AMID_OTHERS), error=last_error(mine),
        handed_back=sum(e["kind"] == "DeliveryEvidence" and evidence_step(e.get("detail")) == "handed_back"
                        for e in events),
        pid=worker_pid(claimed["worker_id"]) if claimed else None,
        claimed=_epoch(claimed["recorded_at"]) if claimed else None,
        authorized=_epoch(authorized["recorded_at"]) if authorized else None,
        ended=_epoch(terminal["recorded_at"]) if terminal else None)


def needs_operator(outcome: str) -> bool:
    return outcome == "OutcomeUnknown" or (outcome.startswith("Failed") and outcome not in NOT_TO_DELIVER)


def causes(recorded: Recorded, faults: Iterable[Fault], now: float, margin: float = MARGIN) -> list[Fault]:
    """The faults that can explain this recorded outcome (see the module's docstring), most likely cause first."""
    start = recorded.claimed if recorded.claimed is not None else -math.inf
    end = recorded.ended if recorded.ended is not None else now
    allowed = CAN_CAUSE.get(recorded.terminal or "")
    found = []
    for f in faults:
        if allowed is not None and f.kind not in allowed:
            continue
        if f.pid is not None and f.pid != recorded.pid:
            continue
        from_ = recorded.authorized if f.kind in PARTNER_FAULTS and recorded.authorized is not None else start
        if f.start <= end + margin and f.until(now) >= from_ - margin:
            found.append(f)

    def rank(f: Fault) -> tuple[bool, int, float]:
        from_ = recorded.authorized if f.kind in PARTNER_FAULTS and recorded.authorized is not None else start
        within = f.start <= end and f.until(now) >= from_
        if f.pid is not None:  # its worker's: the first one (a pause, then a kill while paused: the pause)
            return not within, 0, f.start
        return not within, 1 + GLOBAL_FAULTS.index(f.kind) if f.kind in GLOBAL_FAULTS else len(PRIORITY), -f.start
    return sorted(found, key=rank)


@dataclass(frozen=True)
class NeededOutcome:
    job_id: uuid.UUID
    recorded: Recorded
    causes: list[Fault]
    through: uuid.UUID | None = None  # the original whose outcome explains this replacement's

    @property
    def cause(self) -> str:
        return self.causes[0].kind if self.causes else "unattributed"


@dataclass
class Accounting:
    exports: int
    to_deliver: int  # exports that were to deliver: not Canceled, Stopped, Rejected or Failed/OriginalDelivered
    confirmed: int  # of those, Completed as the system recorded it
    needed: list[NeededOutcome] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # recorded outcome -> exports
    recorded: dict[uuid.UUID, Recorded] = field(default_factory=dict)  # each export's

    def per_thousand(self, n: int) -> float:
        return 1000.0 * n / self.exports if self.exports else 0.0

    @property
    def confirmed_share(self) -> float:
        return self.confirmed / self.to_deliver if self.to_deliver else 1.0

    @property
    def unattributed(self) -> list[NeededOutcome]:
        return [n for n in self.needed if not n.causes]

    def by_kind(self) -> Counter:
        return Counter(n.recorded.outcome for n in self.needed)

    def by_cause(self) -> Counter:
        return Counter(n.cause for n in self.needed)

    def lines(self, floor: float) -> list[str]:
        """The report's lines: per 1,000 exports, by kind and by the class of fault that caused them."""
        out = [f"  operator-needed outcomes         per 1,000 exports ({self.exports} exports)",
               f"    all                            {self.per_thousand(len(self.needed)):7.1f}  ({len(self.needed)})"]
        out += [f"    {kind:<30} {self.per_thousand(n):7.1f}  ({n})" for kind, n in sorted(self.by_kind().items())]
        # Where the attempt was: past its rename fence (the rename may have been sent: out of reach by design), or
        # before it (the attempt provably never renamed).
        for label, renamed in (("past the rename fence", True), ("before the rename fence", False)):
            n = sum(1 for x in self.needed if x.recorded.renamed is renamed)
            out.append(f"    {label:<30} {self.per_thousand(n):7.1f}  ({n})")
        # A replacement that found its original's file at the final name and could not tell it was the original's:
        # its outcome follows from the original's, past its fence.
        n = sum(1 for x in self.needed if not x.recorded.renamed and x.through is not None
                and x.through in self.recorded and self.recorded[x.through].renamed)
        out.append(f"    {'  through an original past it':<30} {self.per_thousand(n):7.1f}  ({n})")
        n = sum(1 for x in self.needed if not x.recorded.renamed and x.recorded.replacement and x.through is None)
        out.append(f"    {'  a replacement, its own':<30} {self.per_thousand(n):7.1f}  ({n})")
        for cause, n in sorted(self.by_cause().items(),
                               key=lambda item: PRIORITY.index(item[0]) if item[0] in PRIORITY else len(PRIORITY)):
            label = cause if cause == "unattributed" else f"caused by {cause}"
            out.append(f"    {label:<30} {self.per_thousand(n):7.1f}  ({n})")
        out.append(f"  confirmed by the system          {self.confirmed} of {self.to_deliver} to deliver "
                   f"({100 * self.confirmed_share:.0f}%, floor {100 * floor:.0f}%)")
        return out

    def notes(self, t0: float) -> list[str]:
        """One line per operator-needed outcome: what was recorded, on which worker, and the faults behind it."""
        out = []
        for n in self.needed:
            r = n.recorded
            window = (f"{r.claimed - t0:.1f}s-{r.ended - t0:.1f}s" if r.claimed is not None and r.ended is not None
                      else "?")
            through = f", through its original {n.through}" if n.through else ""
            fence = ("past its rename fence" if r.renamed else "before its rename fence") + (
                ", a replacement" if r.replacement else "")
            out.append(f"operator needed: {n.job_id} {r.outcome} by {r.terminal} (worker pid {r.pid}, attempt "
                       f"{window}, {fence}{through}): " + ("; ".join(f.describe(t0) for f in n.causes[:3])
                                                   or "NO FAULT EXPLAINS IT") + r.losses
                       + (f"; its evidence: {r.error}" if r.error else ""))
        return out


def account(rows: dict[uuid.UUID, dict[str, Any]], events: dict[uuid.UUID, list[dict[str, Any]]],
            faults: list[Fault], now: float, margin: float = MARGIN) -> Accounting:
    """The operator-needed outcomes of these exports (rows by ID, their events by ID), each with the faults that
    can explain it; and how many of the exports that were to deliver the system confirmed."""
    acc = Accounting(exports=len(rows), to_deliver=0, confirmed=0)
    recorded = acc.recorded = {job_id: recorded_outcome(row, events.get(job_id, [])) for job_id, row in rows.items()}

    def explained(job_id: uuid.UUID) -> tuple[list[Fault], uuid.UUID | None]:
        original, seen = job_id, {job_id}
        while (recorded[original].outcome == "Failed/FinalNameOccupied"
               and (earlier := rows[original].get("replaces_job_id")) in rows and earlier not in seen
               and needs_operator(recorded[earlier].outcome)):
            original = earlier
            seen.add(original)
        return causes(recorded[original], faults, now, margin), None if original == job_id else original

    for job_id, r in recorded.items():
        acc.outcomes[r.outcome] += 1
        if r.outcome not in NOT_TO_DELIVER:
            acc.to_deliver += 1
            acc.confirmed += r.outcome == "Completed"
        if needs_operator(r.outcome):
            acc.needed.append(NeededOutcome(job_id, r, *explained(job_id)))
    return acc

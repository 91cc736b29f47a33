"""Delivery evidence: how an attempt writes it through an outage, and what it says about a Delivering attempt
whose worker went quiet (reference design, Recovery).

`EvidenceLog`: the attempt appends its records in the order it observed them. A record the database did not take
(it was away) is kept and written before the next one, and `flush` writes what is kept before the attempt's
terminal write: an outage delays evidence, never loses or reorders it. A record the database refuses for good (a
value it cannot store) is dropped with an error in the log, since no retry could store it.

A receipt the attempt appended is judged by exactly the rule its worker would have applied after the rename
(activities/outcomes.py). Without one, recovery takes its own look at the final name, with every evidence by
content the destination's contract offers, and accepts it only where the worker's rules would: a final name that
changed from the attempt's baseline (for an original, whose name is unique to its key, an absent or unrecorded
baseline; for a replacement, only its own recorded one, or its recorded overwrite), holding the expected file by
sha256 or acknowledgment where the contract offers one, by size only where it offers none (and for a replacement
only where name and size identify a file by contract). Never Failed from an absent file: a paused worker can
outlast any timeout. Everything else is OutcomeUnknown, for reconciliation.

Only the attempt's holder's records count: the database keeps a record's holder only while that holder held the
Delivering row (store/migrations/versions/0008), so no other role, and no writer naming another attempt, can add a
receipt recovery would take. A malformed record is reported and skipped, and the rest are judged as usual.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypedDict

from pydantic import BaseModel, ConfigDict, ValidationError

from activities import outcomes
from activities.destination import PartnerContract
from store import errors
from store.models import JobRow, Status

log = logging.getLogger(__name__)


class EvidenceLog:
    def __init__(self, append: Callable[[dict[str, Any]], Awaitable[None]], *, attempt: object) -> None:
        self._append = append
        self._attempt = attempt
        self._kept: list[dict[str, Any]] = []

    async def record(self, detail: dict[str, Any]) -> None:
        """Append now if the database answers; otherwise keep it, in order, for the next append or `flush`."""
        self._kept.append(detail)
        try:
            await self.flush()
        except Exception as exc:
            log.warning("evidence of attempt %s (step %s) kept for later, %d record(s) waiting: %s",
                        self._attempt, detail.get("step"), len(self._kept), errors.describe(exc))

    async def flush(self) -> None:
        """Write every kept record, oldest first. Raises the error of one the database may take later."""
        while self._kept:
            try:
                await self._append(self._kept[0])
            except Exception as exc:
                if errors.is_transient(exc):
                    raise
                log.error("evidence of attempt %s (step %s) dropped, the database refused it: %s",
                          self._attempt, self._kept[0].get("step"), errors.describe(exc))
            self._kept.pop(0)


class _Final(BaseModel):
    """What a look at the final name recorded (outcomes.RemoteFile as dumped)."""

    model_config = ConfigDict(extra="allow", strict=True)
    exists: bool
    size: int | None = None


class _Record(BaseModel):
    """The fields of an attempt's evidence that recovery judges by, with the types the attempt wrote. A record
    that does not fit is skipped, never guessed at."""

    model_config = ConfigDict(extra="allow", strict=True)
    step: str
    final: _Final | None = None
    sha256: str | None = None
    sha256_error: str | None = None
    acknowledged_sha256: str | None = None
    overwrite: bool = False
    decision: str | None = None


# The steps `judge` reads; the attempt's other records (whose "final" may be a path, not a listing) are not judged.
JUDGED = frozenset({"baseline", "decision", "receipt"})

HOLDER = "recorded_by_holder"  # added to each record judged by: its provenance, as the database stamped it


class AttemptEvidence(NamedTuple):
    records: list[dict[str, Any]]  # by the attempt's holder, well formed, oldest first
    skipped: list[str]             # one line per record not judged by, and why


def attempt_evidence(events: list[dict[str, Any]], attempt_id: object) -> AttemptEvidence:
    """The DeliveryEvidence records of one attempt that recovery may judge by: appended by the attempt's holder
    while it held the Delivering row (the database keeps `worker_id` only then: migration 0008), and well formed.
    Records by anyone else (the reconciler, recovery's own looks, a writer naming another attempt) are kept for
    people and not judged by; a malformed one is reported and skipped."""
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    for event in events:
        if event["kind"] != "DeliveryEvidence" or event["attempt_id"] != attempt_id or not event["detail"]:
            continue
        if not event.get("worker_id"):
            continue  # not the holder's: recovery's own looks are among these, and are not skipped news
        try:
            detail = json.loads(event["detail"])
            if isinstance(detail, dict) and isinstance(detail.get("step"), str) and detail["step"] not in JUDGED:
                continue  # kept for people (a rename's intent, a retry, a failure), not judged by: not malformed
            _Record.model_validate(detail)
        except ValueError as exc:
            why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "not JSON"
            skipped.append(f"evidence event {event.get('id')} of attempt {attempt_id} is malformed ({why}); skipped")
            continue
        if detail.get("step") == "receipt" and detail.get("final") is None:
            skipped.append(f"evidence event {event.get('id')} of attempt {attempt_id} is a receipt without a "
                           "listing; skipped")
            continue
        records.append({**detail, HOLDER: event["worker_id"]})
    return AttemptEvidence(records, skipped)


class Judgement(NamedTuple):
    resolution: Status
    summary: str
    confirmed_by: outcomes.ConfirmedBy | None = None


def _unknown(summary: str) -> Judgement:
    return Judgement(Status.OUTCOME_UNKNOWN, summary)


def _judged(verdict: outcomes.Verdict, source: str) -> Judgement:
    return Judgement(Status(verdict.outcome), f"{source}: {verdict.summary}", verdict.confirmed_by)


class _Expected(TypedDict):
    """What the attempt promised, as `outcomes.after_rename` weighs a look against it."""

    final_name: str
    expected_bytes: int
    expected_sha256: str | None
    content_promised: bool


def judge(row: JobRow, evidence: list[dict[str, Any]], look: outcomes.FinalLook | None,
          contract: PartnerContract) -> Judgement:
    expected_bytes = row.expected_file_bytes or 0
    expected_sha256 = row.expected_file_sha256.hex() if row.expected_file_sha256 else None
    overwrite = any(r.get("step") == "decision" and r.get("decision") == "Overwrite" for r in evidence)
    rule = _Expected(final_name=row.expected_file_name or "", expected_bytes=expected_bytes,
                     expected_sha256=expected_sha256, content_promised=contract.hash_evidence != "none")

    receipts = [r for r in evidence if r.get("step") == "receipt"]
    if receipts:
        receipt = receipts[-1]
        final = receipt.get("final") or {}
        seen = outcomes.FinalLook(exists=bool(final.get("exists")), size=final.get("size"),
                                  sha256=receipt.get("sha256"), sha256_error=receipt.get("sha256_error"),
                                  acknowledged_sha256=receipt.get("acknowledged_sha256"))
        return _judged(outcomes.after_rename(seen, overwrite=overwrite or bool(receipt.get("overwrite")), **rule),
                       f"receipt appended by the attempt's holder {receipt.get(HOLDER)}")

    name = row.expected_file_name
    if look is None:
        return _unknown("no receipt, and the destination could not be looked at")
    if not look.exists:
        return _unknown(f"look: {name} absent; the attempt may still upload")
    baselines = [r for r in evidence if r.get("step") == "baseline"]
    occupied_before = bool(baselines) and bool((baselines[0].get("final") or {}).get("exists"))
    if row.replaces_job_id is not None and not baselines:
        # A file under a replacement's name may be the original's: only this attempt's own baseline counts.
        return _unknown(f"look: {name} exists, but no baseline was recorded by this replacement")
    if occupied_before and not overwrite:
        return _unknown(f"look: {name} exists, but the name was occupied before the upload")
    if look.content_sha256 is None and contract.hash_evidence == "none":
        if row.replaces_job_id is not None and not contract.name_and_size_identify:
            return _unknown(f"look: {name} exists, but without evidence by content a replacement's file is "
                            "identified by name and size only where the contract says so")
    return _judged(outcomes.after_rename(look, overwrite=overwrite, **rule), "look")

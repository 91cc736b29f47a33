"""What the evidence says about a Delivering attempt whose worker went quiet (reference design, Recovery).

Completed only on evidence: a receipt the attempt appended that matches the expected file, or a listing of the
final name with the expected size that changed from the attempt's baseline (for an original, whose name is unique
to its delivery key, the baseline is an absent file). Never Failed from an absent file: a paused worker can
outlast any timeout. Everything else is OutcomeUnknown, for reconciliation.
"""

from __future__ import annotations

import json
from typing import Any

from activities.partner import RemoteFile
from store.models import JobRow, Status


def attempt_evidence(events: list[dict[str, Any]], attempt_id: object) -> list[dict[str, Any]]:
    """The DeliveryEvidence records of one attempt, oldest first, as the dicts the attempt appended."""
    found = []
    for event in events:
        if event["kind"] == "DeliveryEvidence" and event["attempt_id"] == attempt_id and event["detail"]:
            try:
                found.append(json.loads(event["detail"]))
            except ValueError:
                continue
    return found


def judge(row: JobRow, evidence: list[dict[str, Any]], listing: RemoteFile | None) -> tuple[Status, str]:
    expected = row.expected_file_bytes
    for record in evidence:
        final = record.get("final") or {}
        if record.get("step") == "receipt" and final.get("exists") and final.get("size") == expected:
            return Status.COMPLETED, f"receipt appended by the attempt: {row.expected_file_name}, {expected} bytes"
    baselines = [r for r in evidence if r.get("step") == "baseline"]
    if row.replaces_job_id is None:
        baseline_absent = not baselines or not (baselines[0].get("final") or {}).get("exists")
    else:
        # A file under a replacement's name may be the original's: only this attempt's own baseline counts.
        baseline_absent = bool(baselines) and not (baselines[0].get("final") or {}).get("exists")
    if listing is None:
        return Status.OUTCOME_UNKNOWN, "no receipt, and the destination could not be listed"
    if listing.exists and listing.size == expected and baseline_absent:
        return Status.COMPLETED, (f"listing: {row.expected_file_name} holds the expected {expected} bytes, "
                                  "changed from an absent baseline")
    if listing.exists:
        why = ("no baseline recorded by this replacement" if row.replaces_job_id and not baselines
               else f"{listing.size} bytes where {expected} were expected" if listing.size != expected
               else "the name was occupied before the upload")
        return Status.OUTCOME_UNKNOWN, f"listing: {row.expected_file_name} exists, but {why}"
    return Status.OUTCOME_UNKNOWN, f"listing: {row.expected_file_name} absent; the attempt may still upload"

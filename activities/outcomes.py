"""The outcome rules of a delivery: pure functions, no I/O, so that they can be read and tested on their own.

What a look at the partner's final name proves about one attempt's delivery (`after_rename`) is shared by the
delivery (right after its own rename) and by recovery (from a receipt the attempt appended, or from its own look),
so that both decide alike from the same evidence.

| the final name holds                                        | outcome        |
| ----------------------------------------------------------- | -------------- |
| nothing, or another size than the expected file             | OutcomeUnknown |
| the expected size, and a sha256 (or acknowledgment) equal   | Completed      |
|   to the expected file's                                    |                |
| the expected size, and a sha256 (or acknowledgment) that    | OutcomeUnknown |
|   differs                                                   |                |
| the expected size, no evidence by content, after an         | OutcomeUnknown |
|   overwrite (a rebuilt file can have the same size)         |                |
| the expected size, no evidence by content although the      | OutcomeUnknown |
|   contract promises it (read_back, check_file)              |                |
| the expected size, no evidence by content, none promised,   | Completed      |
|   no overwrite (a listing changed from an absent baseline)  |  (by size)     |

What a failed delivery means at the partner (`classify`), from where it failed and a listing taken afterwards on a
new connection (the baseline is always "absent": a present final name never gets past the baseline):

| failed at                            | fresh listing of the final name  | outcome                    |
| ------------------------------------ | -------------------------------- | -------------------------- |
| connect, baseline                    | (not taken)                      | Failed/NotDelivered        |
| upload, rename, confirm              | could not be taken               | OutcomeUnknown             |
| upload                               | absent                           | Failed/NotDelivered        |
| rename, refused by the server        | absent                           | Failed/NotDelivered        |
| rename interrupted, confirm          | absent                           | OutcomeUnknown             |
| upload, rename, confirm              | present                          | OutcomeUnknown             |

The temporary file is removed after a failure only where no rename can be under way (`temp_file_removable`).
A final name already occupied at the baseline (`occupied_final_name`) is never touched: the delivery fails
FinalNameOccupied, or OriginalDelivered for a replacement that identified its original's file there, unless the
replacement holds an overwrite agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import asyncssh
from pydantic import BaseModel, ConfigDict

Outcome = Literal["Completed", "OutcomeUnknown"]
ConfirmedBy = Literal["sha256", "acknowledgment", "size"]
# Where a delivery was when it failed; see `classify`.
Step = Literal["connect", "baseline", "upload", "rename", "confirm"]
NOTHING_WRITTEN_YET: frozenset[str] = frozenset({"connect", "baseline"})
# What a delivery decides when its baseline finds the final name occupied; see `occupied_final_name`.
OccupiedDecision = Literal["FinalNameOccupied", "OriginalDelivered", "Overwrite"]


class RemoteFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    exists: bool
    size: int | None = None
    mtime: int | None = None


class DeliveryResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: Literal["Completed", "Failed", "OutcomeUnknown"]
    failure_reason: Literal["NotDelivered", "FinalNameOccupied", "OriginalDelivered"] | None = None
    summary: str
    receipt: RemoteFile | None = None
    confirmed_by: ConfirmedBy | None = None  # what made a Completed true
    # Not delivered, proven (nothing written, or a fresh listing shows the final name untouched after a failure
    # before the rename was sent), by a fault that may pass (a cut, a timeout): the attempt may try again.
    retry_safe: bool = False
    # Failed before its rename request was sent (connect, baseline, upload, or refused at its rename fence): whatever
    # is at the final name, this attempt did not put it there.
    before_rename: bool = False


class Verdict(NamedTuple):
    outcome: Outcome
    summary: str
    confirmed_by: ConfirmedBy | None = None  # what made a Completed true


@dataclass(frozen=True)
class FinalLook:
    """One look at the final name: its listing and whatever evidence by content was had."""

    exists: bool
    size: int | None = None
    sha256: str | None = None  # hashed by read-back or by the partner (check-file), as the contract offers
    sha256_error: str | None = None  # why the contract's hash could not be had
    acknowledged_sha256: str | None = None  # from the partner's acknowledgment file

    @property
    def content_sha256(self) -> str | None:
        """The content's SHA-256 as the evidence tells it: the bytes read back, else the partner's acknowledgment
        (an acknowledgment never outweighs other bytes read back at the final name)."""
        return self.sha256 if self.sha256 is not None else self.acknowledged_sha256

    def proves(self, expected_sha256: str | None) -> Literal["sha256", "acknowledgment"] | None:
        """What proves the expected content, if anything: the delivery, recovery and the follow-up judge alike."""
        if expected_sha256 is None or self.content_sha256 != expected_sha256:
            return None
        return "sha256" if self.sha256 is not None else "acknowledgment"


def after_rename(look: FinalLook, *, final_name: str, expected_bytes: int, expected_sha256: str | None,
                 overwrite: bool, content_promised: bool) -> Verdict:
    """The outcome of an attempt whose rename into `final_name` was acknowledged, from a look taken after it."""
    if not look.exists or look.size != expected_bytes:
        found = f"{look.size} bytes" if look.exists else "no file"
        return Verdict("OutcomeUnknown", f"outcome unknown: {final_name} holds {found} after the rename, "
                                         f"expected {expected_bytes} bytes")
    proof = look.proves(expected_sha256)
    if proof == "sha256":
        return Verdict("Completed", f"uploaded {final_name}, {expected_bytes} bytes, confirmed by sha256", proof)
    if proof == "acknowledgment":
        return Verdict("Completed", f"uploaded {final_name}, {expected_bytes} bytes, confirmed by the partner's "
                                    "acknowledgment", proof)
    if look.content_sha256 is not None:
        return Verdict("OutcomeUnknown", f"outcome unknown: {final_name} holds {expected_bytes} bytes, but their "
                                         "sha256 is not the expected file's")
    if overwrite:
        return Verdict("OutcomeUnknown", f"outcome unknown: {final_name} was overwritten with {expected_bytes} "
                                         "bytes, and no hash or acknowledgment confirms this upload")
    if content_promised:
        return Verdict("OutcomeUnknown", f"outcome unknown: {final_name} holds {expected_bytes} bytes, but the "
                                         "evidence by content the contract promises could not be had: "
                                         f"{look.sha256_error or 'no answer'}")
    return Verdict("Completed", f"uploaded {final_name}, {expected_bytes} bytes, confirmed by size", "size")


def follow_up_verdict(look: FinalLook, *, final_name: str, expected_sha256: str | None) -> Verdict:
    """What the evidence follow-up may conclude from one look: Completed only on proof of content (the SHA-256 read
    back is the expected file's, or, with nothing read back, the partner's acknowledgment names it). Absence and
    size settle nothing: a partner may have taken the file, and bytes of the right length may be others."""
    if expected_sha256 is None:
        return Verdict("OutcomeUnknown", "no expected SHA-256 was recorded: nothing can prove the content")
    proof = look.proves(expected_sha256)
    if proof == "sha256":
        return Verdict("Completed", f"{final_name} read back: sha256 {expected_sha256} is the expected file's", proof)
    if proof == "acknowledgment":
        return Verdict("Completed", f"the partner's acknowledgment of {final_name} names sha256 {expected_sha256}, "
                                    "the expected file's", proof)
    found = (f"{final_name} holds {look.size} bytes" if look.exists else f"{final_name} is absent")
    if look.sha256 is not None:
        found += f" whose sha256 is {look.sha256}, not the expected file's"
    if look.acknowledged_sha256 is not None:
        found += f"; its acknowledgment names {look.acknowledged_sha256[:64]}, not the expected file"
    if look.sha256_error:
        found += f"; {look.sha256_error}"
    return Verdict("OutcomeUnknown", f"not settled: {found}")


def receipt_look(final: RemoteFile, sha256: str | None, sha256_error: str | None,
                 acknowledged_sha256: str | None) -> FinalLook:
    return FinalLook(exists=final.exists, size=final.size, sha256=sha256, sha256_error=sha256_error,
                     acknowledged_sha256=acknowledged_sha256)


def occupied_final_name(final_name: str, found: RemoteFile, identified: tuple[bool, str] | None,
                        overwrite_agreed: bool) -> tuple[OccupiedDecision, str, DeliveryResult | None]:
    """What a delivery does when its baseline found `final_name` occupied by `found`: the decision, why, and the
    result that ends the delivery without an upload (None for an agreed overwrite). `identified` is, for a
    replacement only, whether the file was identified as its original's delivery and on what evidence."""
    decision: Literal["FinalNameOccupied", "OriginalDelivered"] = "FinalNameOccupied"  # either is a failure
    why = "an original's name is unique to its key"
    if identified is not None:
        # A replacement reuses its original's name: the file may be the original's own delivery.
        is_original, why = identified
        if is_original:
            decision = "OriginalDelivered"
        elif overwrite_agreed:
            return "Overwrite", why, None
    # Someone else's file, or the original's: never touch it, and upload nothing at all.
    return decision, why, DeliveryResult(
        outcome="Failed", failure_reason=decision,
        summary=f"not delivered: {final_name} already exists at the partner ({found.size} bytes); {why}",
    )


def describe(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:300]



def refused_by_server(exc: BaseException) -> bool:
    """A status reply from the server: the request was processed and not carried out, whatever its code (SFTP v3
    reports "name exists" as a plain failure, a missing directory as no such file). SFTPConnectionLost and
    SFTPNoConnection are SFTPErrors the client makes up itself when the channel dies: they say nothing about what
    the server did."""
    return isinstance(exc, asyncssh.SFTPError) and not isinstance(
        exc, (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection))


def temp_file_removable(exc: BaseException, step: Step) -> bool:
    """Whether the temporary file may be removed after a failure at `step` (once something may have been written).

    A rename that was sent and not refused may still be under way in the server (OpenSSH links the new name and
    then unlinks the old one): removing the temporary name now could make it take the final name back. So after
    an uncertain rename, or once it was acknowledged, touch nothing; the partner sweep removes the temporary file
    later, by its age."""
    return step == "upload" or (step == "rename" and refused_by_server(exc))


def classify(exc: BaseException, step: Step, fresh_listing: RemoteFile | None) -> DeliveryResult:
    """What a failed delivery means at the partner, from where it failed and a listing taken afterwards.

    `step` is where the delivery was: "connect" and "baseline" come before anything is written; "upload"
    ends just before the rename request is sent; "rename" lasts until the server answers it; "confirm" is the
    listing after an acknowledged rename. `fresh_listing` is the final name as listed on a new connection
    after the failure, or None when that listing could not be taken. The baseline is always "absent": a
    present final name never gets past the baseline.

    - connect/baseline: Failed/NotDelivered. No upload was started, so nothing can be at the partner.
    - upload: Failed/NotDelivered if the fresh listing still shows the final name absent: no rename was sent,
      and the temporary directory is invisible to the partner. A present final name was not put there by this
      delivery, but it is unexplained, so OutcomeUnknown.
    - rename refused by the server (an SFTP status reply, e.g. the name appeared after the baseline):
      Failed/NotDelivered only if the fresh listing still shows the final name absent, else OutcomeUnknown.
    - everything else is OutcomeUnknown: no fresh listing; a rename interrupted (timeout, lost connection,
      cancellation), because the server may have carried it out and the partner may already have taken
      the file; a failure after an acknowledged rename, which is left to a person to confirm.
    """
    error = describe(exc)
    if step in NOTHING_WRITTEN_YET:
        return DeliveryResult(
            outcome="Failed", failure_reason="NotDelivered",
            summary=f"not delivered: {step} failed before any upload started ({error})",
        )
    if fresh_listing is None:
        return DeliveryResult(
            outcome="OutcomeUnknown",
            summary=f"outcome unknown: {step} failed ({error}) and the final name could not be listed again",
        )
    if not fresh_listing.exists:
        if step == "upload":
            return DeliveryResult(
                outcome="Failed", failure_reason="NotDelivered",
                summary=f"not delivered: upload failed before the rename was sent ({error}); "
                        "final name still absent",
            )
        if step == "rename" and refused_by_server(exc):
            return DeliveryResult(
                outcome="Failed", failure_reason="NotDelivered",
                summary=f"not delivered: the server refused the rename ({error}); final name still absent",
            )
        return DeliveryResult(
            outcome="OutcomeUnknown",
            summary=f"outcome unknown: {step} failed ({error}); final name absent, "
                    "but the partner may have taken it",
        )
    return DeliveryResult(
        outcome="OutcomeUnknown",
        summary=f"outcome unknown: {step} failed ({error}); final name now holds {fresh_listing.size} bytes "
                "that cannot be proven to be this delivery's",
    )

"""What a look at the partner's final name proves about one attempt's delivery: pure functions, shared by the
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Outcome = Literal["Completed", "OutcomeUnknown"]
ConfirmedBy = Literal["sha256", "acknowledgment", "size"]


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
        return self.sha256 if self.sha256 is not None else self.acknowledged_sha256


def after_rename(look: FinalLook, *, final_name: str, expected_bytes: int, expected_sha256: str | None,
                 overwrite: bool, content_promised: bool) -> Verdict:
    """The outcome of an attempt whose rename into `final_name` was acknowledged, from a look taken after it."""
    if not look.exists or look.size != expected_bytes:
        found = f"{look.size} bytes" if look.exists else "no file"
        return Verdict("OutcomeUnknown", f"outcome unknown: {final_name} holds {found} after the rename, "
                                         f"expected {expected_bytes} bytes")
    content = look.content_sha256
    if content is not None and content == expected_sha256:
        if look.sha256 is not None:
            return Verdict("Completed", f"uploaded {final_name}, {expected_bytes} bytes, confirmed by sha256",
                           "sha256")
        return Verdict("Completed", f"uploaded {final_name}, {expected_bytes} bytes, confirmed by the partner's "
                                    "acknowledgment", "acknowledgment")
    if content is not None:
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

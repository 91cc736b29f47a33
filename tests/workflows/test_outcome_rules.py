"""The outcome rules of a delivery (activities/outcomes.py), as a table, with no server: what a failure means at the
partner from where it happened and a fresh listing, when the temporary file may be removed, what an occupied final
name decides, and what a look after the rename proves."""

from __future__ import annotations

import asyncssh
import pytest

from activities.outcomes import (
    FinalLook,
    RemoteFile,
    after_rename,
    classify,
    follow_up_verdict,
    occupied_final_name,
    temp_file_removable,
)

ABSENT = RemoteFile(path="/out/f.csv", exists=False)
PRESENT = RemoteFile(path="/out/f.csv", exists=True, size=10)
LOST = asyncssh.ConnectionLost("lost")
REFUSED = asyncssh.SFTPFailure("exists")  # a status reply: the server processed the rename and did not do it
CHANNEL_DIED = asyncssh.SFTPConnectionLost("lost")  # made up by the client: says nothing about the server


@pytest.mark.parametrize(
    ("exc", "step", "listing", "outcome", "reason"),
    [
        # Before anything was written: proven not delivered, with or without a listing.
        (OSError("refused"), "connect", None, "Failed", "NotDelivered"),
        (LOST, "baseline", None, "Failed", "NotDelivered"),
        (LOST, "baseline", PRESENT, "Failed", "NotDelivered"),
        # No fresh listing: nothing can be proven.
        (LOST, "upload", None, "OutcomeUnknown", None),
        (REFUSED, "rename", None, "OutcomeUnknown", None),
        (LOST, "confirm", None, "OutcomeUnknown", None),
        # The upload failed before the rename was sent: the final name still absent proves it.
        (LOST, "upload", ABSENT, "Failed", "NotDelivered"),
        (TimeoutError(), "upload", ABSENT, "Failed", "NotDelivered"),
        # The server refused the rename, and the final name is still absent.
        (REFUSED, "rename", ABSENT, "Failed", "NotDelivered"),
        # A rename interrupted may have been carried out, and the partner may have taken the file.
        (CHANNEL_DIED, "rename", ABSENT, "OutcomeUnknown", None),
        (TimeoutError(), "rename", ABSENT, "OutcomeUnknown", None),
        (LOST, "rename", ABSENT, "OutcomeUnknown", None),
        # After an acknowledged rename: left to a person to confirm.
        (LOST, "confirm", ABSENT, "OutcomeUnknown", None),
        # A final name that appeared is unexplained, whatever the step.
        (LOST, "upload", PRESENT, "OutcomeUnknown", None),
        (REFUSED, "rename", PRESENT, "OutcomeUnknown", None),
        (LOST, "confirm", PRESENT, "OutcomeUnknown", None),
    ],
)
def test_classify(exc: BaseException, step: str, listing: RemoteFile | None, outcome: str,
                  reason: str | None) -> None:
    result = classify(exc, step, listing)  # type: ignore[arg-type]
    assert (result.outcome, result.failure_reason) == (outcome, reason)
    assert type(exc).__name__ in result.summary


@pytest.mark.parametrize(
    ("exc", "step", "removable"),
    [
        (LOST, "upload", True),
        (REFUSED, "rename", True),
        (CHANNEL_DIED, "rename", False),  # the rename may still be under way in the server
        (TimeoutError(), "rename", False),
        (LOST, "confirm", False),  # renamed: the temporary name is gone or belongs to the rename
    ],
)
def test_temp_file_removable(exc: BaseException, step: str, removable: bool) -> None:
    assert temp_file_removable(exc, step) is removable  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("identified", "overwrite_agreed", "decision", "ends"),
    [
        (None, False, "FinalNameOccupied", True),  # an original: its name is unique to its key
        (None, True, "FinalNameOccupied", True),  # an agreement is a replacement's only
        ((True, "checksum matches"), False, "OriginalDelivered", True),
        ((True, "checksum matches"), True, "OriginalDelivered", True),  # never overwrite the original's file
        ((False, "not identified"), False, "FinalNameOccupied", True),
        ((False, "not identified"), True, "Overwrite", False),
    ],
)
def test_occupied_final_name(identified: tuple[bool, str] | None, overwrite_agreed: bool, decision: str,
                             ends: bool) -> None:
    decided, why, result = occupied_final_name("f.csv", PRESENT, identified, overwrite_agreed)
    assert decided == decision
    assert why == (identified[1] if identified else "an original's name is unique to its key")
    if ends:
        assert result is not None and (result.outcome, result.failure_reason) == ("Failed", decision)
        assert "f.csv already exists at the partner (10 bytes)" in result.summary
    else:
        assert result is None


SHA = "a" * 64
OTHER = "b" * 64


@pytest.mark.parametrize(
    ("look", "overwrite", "promised", "outcome", "confirmed_by"),
    [
        (FinalLook(exists=False), False, False, "OutcomeUnknown", None),
        (FinalLook(exists=True, size=9), False, False, "OutcomeUnknown", None),
        (FinalLook(exists=True, size=10, sha256=SHA), False, True, "Completed", "sha256"),
        (FinalLook(exists=True, size=10, acknowledged_sha256=SHA), True, False, "Completed", "acknowledgment"),
        (FinalLook(exists=True, size=10, sha256=OTHER), False, True, "OutcomeUnknown", None),
        (FinalLook(exists=True, size=10), True, False, "OutcomeUnknown", None),  # a rebuilt file has this size too
        (FinalLook(exists=True, size=10, sha256_error="no answer"), False, True, "OutcomeUnknown", None),
        (FinalLook(exists=True, size=10), False, False, "Completed", "size"),
    ],
)
def test_after_rename(look: FinalLook, overwrite: bool, promised: bool, outcome: str,
                      confirmed_by: str | None) -> None:
    verdict = after_rename(look, final_name="f.csv", expected_bytes=10, expected_sha256=SHA, overwrite=overwrite,
                           content_promised=promised)
    assert (verdict.outcome, verdict.confirmed_by) == (outcome, confirmed_by)


@pytest.mark.parametrize(
    ("look", "outcome", "confirmed_by"),
    [
        (FinalLook(exists=False), "OutcomeUnknown", None),  # a partner may have taken the file
        (FinalLook(exists=True, size=10), "OutcomeUnknown", None),  # bytes of the right length may be others
        (FinalLook(exists=True, size=10, sha256=SHA), "Completed", "sha256"),
        (FinalLook(exists=False, acknowledged_sha256=SHA), "Completed", "acknowledgment"),
        (FinalLook(exists=True, size=10, acknowledged_sha256=SHA), "Completed", "acknowledgment"),
        # Bytes read back come first, as for the delivery and recovery: other bytes are not outweighed.
        (FinalLook(exists=True, size=10, sha256=OTHER, acknowledged_sha256=SHA), "OutcomeUnknown", None),
        (FinalLook(exists=True, size=10, sha256=SHA, acknowledged_sha256=OTHER), "Completed", "sha256"),
    ],
)
def test_follow_up_verdict(look: FinalLook, outcome: str, confirmed_by: str | None) -> None:
    verdict = follow_up_verdict(look, final_name="f.csv", expected_sha256=SHA)
    assert (verdict.outcome, verdict.confirmed_by) == (outcome, confirmed_by)

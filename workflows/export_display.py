"""What the UI shows of an export's run: its search attributes and its current details.

The search attributes follow every state the run learns of, from the row or from the step that just committed it
(a claim, cutoff 2): one upsert per change of status, attempts or how a Completed was confirmed, never more (each
is a command in the history, and a billable action). The current details say who, why and what in words, without
opening any JSON; they are not a command, so their text may change freely.
"""

from __future__ import annotations

from collections import deque

from temporalio import workflow

from workflows.export_state import RunState

with workflow.unsafe.imports_passed_through():
    from store.models import Status
    from workflows.identity import DELIVERY_KEY, EXPORT_ATTEMPTS, EXPORT_CONFIRMED_BY, EXPORT_STATUS, EXPORT_TENANT


_ASKED_KEPT = 10
_REJECTED_KEPT = 100


class Display:
    def __init__(self, state: RunState) -> None:
        self._state = state
        self._shown: tuple[Status, int, str | None] | None = None
        # What operators asked of the run (who, what, and what came of it), and the signals it refused: the last
        # few of each, so that a flood of signals never grows the run's memory without bound (LD7).
        self.asked: deque[str] = deque(maxlen=_ASKED_KEPT)
        self.rejected: deque[str] = deque(maxlen=_REJECTED_KEPT)
        self.rejected_count = 0

    def show(self, status: Status, attempts: int) -> None:
        """The search attributes and the details, for a state the run learned of."""
        self.describe(status, attempts)
        row = self._state.row
        assert row is not None
        confirmed_by = row.confirmed_by if status is Status.COMPLETED else None
        if self._shown == (status, attempts, confirmed_by):
            return
        self._shown = (status, attempts, confirmed_by)
        workflow.upsert_search_attributes(
            [
                EXPORT_STATUS.value_set(status.value),
                EXPORT_TENANT.value_set(str(row.tenant_id)),
                DELIVERY_KEY.value_set(row.delivery_key),
                EXPORT_ATTEMPTS.value_set(attempts),
                EXPORT_CONFIRMED_BY.value_set(confirmed_by) if confirmed_by else EXPORT_CONFIRMED_BY.value_unset(),
            ]
        )

    def reject(self, line: str) -> None:
        """A signal refused, or a request that could not be recorded: kept for the query, counted in the details."""
        self.rejected.append(line)
        self.rejected_count += 1

    def ask(self, line: str) -> None:
        """An operator's request and its answer, added to the details."""
        self.asked.append(line)
        self.describe()

    def describe(self, status: Status | None = None, attempts: int | None = None) -> None:
        """The current details: the state shown (or this one), why, the file, the last requests."""
        row = self._state.row
        if row is None:
            return
        if status is None or attempts is None:
            status, attempts = self._shown[:2] if self._shown else (row.status, row.attempt_count)
        lines = [f"**{status.value}**, attempt {attempts}"]
        if status is Status.FAILED and row.failure_reason:
            lines[0] += f": {row.failure_reason.value}"
        if status is Status.REJECTED and row.rejection_reason:
            lines.append(f"rejected: {row.rejection_reason}")
        elif self._state.why:
            lines.append(self._state.why)
        if row.expected_file_name and status in (Status.DELIVERING, Status.COMPLETED, Status.OUTCOME_UNKNOWN):
            digest = row.expected_file_sha256.hex() if row.expected_file_sha256 else "?"
            lines.append(f"file {row.expected_file_name}, {row.expected_file_bytes} bytes, sha256 {digest}")
        if status is Status.COMPLETED and row.confirmed_by:
            lines.append(f"confirmed by {row.confirmed_by}")
        lines.extend(self.asked)
        if self.rejected_count:
            lines.append(f"{self.rejected_count} signal(s) rejected: the last {len(self.rejected)} in the "
                         "rejected_signals query")
        workflow.set_current_details("\n\n".join(lines))

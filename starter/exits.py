"""How every `exports` command ends when it does not succeed: the exit statuses (README, "Bad input ...") and the
one line that goes with each error, for the root command (starter/cli.py) and `exports destinations`
(starter/destinations.py) alike. The lines are raw text: whoever prints one escapes what operators typed."""

from __future__ import annotations

import typer
from pydantic import ValidationError
from temporalio.service import RPCError, RPCStatusCode

try:  # typer 0.2x carries its own click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on click
    # The fallback for a typer older than the lock's, which depended on click; the lock installs no click.
    from click import exceptions as click_exceptions  # type: ignore[import-not-found, no-redef]

from activities.process.temporal import Unreachable, short_reason, temporal_target
from starter.client import InputError, SignalNotSent
from store import errors
from store.errors import StoreError
from store.settings import setting_problem

EXIT_UNEXPECTED = 1  # a bug: one line; EXPORTS_TRACEBACK=1 prints the traceback as well
EXIT_CHECK_FAILED = 1  # `exports destinations check` found what would stop a delivery
EXIT_BAD_INPUT = 2  # nothing was written
EXIT_NOT_DONE = 3  # nothing changed (Busy, or the row moved on): read it again, retry with the same request ID
EXIT_REFUSED = 4  # the database (or Temporal) refused it, e.g. a role that may not do this: nothing changed
EXIT_UNREACHABLE = 5  # PostgreSQL or Temporal could not be reached (not configured, refused, silent)
EXIT_INTERRUPTED = 130  # Ctrl-C

_UNAVAILABLE = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED)

# A bare `exports` raises it: no error, the root command prints its help (exit status 0).
NoArgsIsHelpError = click_exceptions.NoArgsIsHelpError


class DatabaseFailure(Exception):
    """A database error of a command that does not check its connection first (`exports destinations`, whose
    commands are one statement each): a definite refusal is refused, anything else means the database was not
    reached and nothing was written."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def answer(exc: Exception) -> tuple[int, str]:
    """The exit status and the one line for an exception that ended a command."""
    if isinstance(exc, click_exceptions.UsageError):  # an unknown option, a missing argument, ...
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        return EXIT_BAD_INPUT, f"error: {exc.format_message()}{hint}"
    if isinstance(exc, click_exceptions.ClickException):
        return EXIT_BAD_INPUT, f"error: {exc.format_message()}"
    if isinstance(exc, typer.Abort):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, InputError):
        return EXIT_BAD_INPUT, f"error: {exc}"
    if isinstance(exc, ValidationError):  # a malformed EXPORTS_* setting, read by a command without cli._settings
        return EXIT_BAD_INPUT, f"error: {setting_problem(exc)}"
    if isinstance(exc, DatabaseFailure):
        refusal = errors.translate(exc.error)
        if isinstance(refusal, StoreError):  # a definite refusal, e.g. a role that may not write
            return EXIT_REFUSED, f"refused: {refusal}"
        return EXIT_UNREACHABLE, (f"unreachable: the database: {gist(errors.postgres_error(exc.error) or exc.error)}"
                                  f"; nothing was written")
    if isinstance(exc, Unreachable):
        return EXIT_UNREACHABLE, f"unreachable: {exc}; nothing was written"
    if isinstance(exc, SignalNotSent):
        if exc.error.status in _UNAVAILABLE:
            code, prefix = EXIT_UNREACHABLE, f"unreachable: Temporal ({address_setting()})"
        else:
            code, prefix = EXIT_REFUSED, "refused by Temporal"
        return code, (f"{prefix}: {exc}; the cancellation stands (the row decides): run the same command with "
                      f"--request-id {exc.result.request_id} to signal the workflow again")
    if isinstance(exc, RPCError):
        if exc.status in _UNAVAILABLE:
            return EXIT_UNREACHABLE, f"unreachable: Temporal ({address_setting()}): {exc.message}"
        return EXIT_REFUSED, f"refused by Temporal: {exc.message}"
    if isinstance(exc, StoreError):  # a definite refusal from the database, e.g. a role that may not do this
        return EXIT_REFUSED, f"refused: {exc}"
    if errors.is_uncertain(exc) and _from_database(exc):
        return EXIT_UNREACHABLE, (f"unreachable: the connection to PostgreSQL was lost during the command "
                                  f"({short_reason(exc)}); it may or may not have been recorded: read the export "
                                  f"again (exports show) before retrying")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return EXIT_UNREACHABLE, f"unreachable: a connection was lost or not answered ({short_reason(exc)})"
    server = errors.postgres_error(exc)
    if server is not None:  # the server answered and refused the statement; its transaction rolled back
        return EXIT_REFUSED, f"refused by PostgreSQL: {server}"
    return EXIT_UNEXPECTED, (f"error: unexpected {type(exc).__name__}: {exc} (a bug; EXPORTS_TRACEBACK=1 prints "
                             f"the traceback)")


def gist(exc: BaseException) -> str:
    """An error's type and the first line of what it says (a server's `reason` when it gives one)."""
    text = str(getattr(exc, "reason", "") or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def address_setting() -> str:
    """The setting the Temporal address comes from, for a message about a connection lost after it was made; the
    project's own name when the settings cannot be read any more."""
    from store.settings import get_settings

    try:
        return temporal_target(get_settings()).address_setting
    except Exception:  # noqa: BLE001 - only a message depends on it
        return "EXPORTS_TEMPORAL_ADDRESS"


def _from_database(exc: BaseException) -> bool:
    """Whether the driver or SQLAlchemy raised it, or wrapped it, on the way out."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if type(current).__module__.split(".")[0] in ("asyncpg", "sqlalchemy"):
            return True
        seen.add(id(current))
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False

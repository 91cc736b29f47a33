"""Matrix case HI6: every `exports` command answers an unreachable PostgreSQL or Temporal, an out-of-range number
and any malformed value with one line on stderr and a documented exit status, never a traceback, and writes
nothing; text that operators typed (markup, terminal escapes) is printed literally.

The commands run as operators run them: `.venv/bin/exports` in a process of its own, with EXPORTS_* pointing at
this test's PostgreSQL and the session's Temporal dev server, or at a closed port, or at a server that accepts the
connection and never answers. Only what a command line cannot carry (a NUL byte) and the property-based runs (many
examples) call the same command object in this process."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
import time
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.service import RPCError, RPCStatusCode
from typer.testing import CliRunner

from starter import cli, exits
from starter.client import ExportsClient, SignalNotSent
from store.models import FailureCode, Status
from store.settings import get_settings
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, seed_tenant

pytestmark = pytest.mark.spec("HI6")

EXPORTS = Path(sys.executable).parent / "exports"
ROOT = Path(__file__).resolve().parents[2]
TABLES = ("export_jobs", "deliveries", "outbox", "cancellation_requests", "export_attempt_events",
          "destinations")
# A command that cannot reach a component answers within its connection bound (5 s) plus its own start-up.
ANSWER_BOUND = 20.0
RUN_BOUND = 60.0
INT4_MAX = 2**31 - 1


# --- running the command --------------------------------------------------------------------------------------------


class Ran:
    def __init__(self, code: int, stdout: str, stderr: str, seconds: float) -> None:
        self.code, self.stdout, self.stderr, self.seconds = code, stdout, stderr, seconds

    def __repr__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\nstdout: {self.stdout!r}\nstderr: {self.stderr[-3000:]!r}"


async def exports(env: dict[str, str], *args: str | bytes, cwd: Path) -> Ran:
    """The installed `exports` command in a process of its own; the environment is the test's EXPORTS_* only."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("EXPORTS_") and k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS")}
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        EXPORTS, *args, env={**clean, "TERM": "dumb", "COLUMNS": "250", **env}, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), RUN_BOUND)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"exports {args} did not answer within {RUN_BOUND} s") from None
    return Ran(process.returncode, out.decode("utf-8", "backslashreplace"),
               err.decode("utf-8", "backslashreplace"), time.monotonic() - started)


def in_process(env: dict[str, str], *args: str) -> Ran:
    """The same command object in this process (for a NUL byte, which no command line can carry, and for many
    examples); run it in a thread, since it runs its own event loop."""
    get_settings.cache_clear()
    started = time.monotonic()
    try:
        result = CliRunner().invoke(cli.app, list(args), env=env)
    finally:
        get_settings.cache_clear()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"exports {args} raised {result.exception!r}") from result.exception
    return Ran(result.exit_code, result.stdout, result.stderr, time.monotonic() - started)


async def run(world: dict, *args: str | bytes, process: bool) -> Ran:
    """In a process of its own, or (for cases that differ only in a value) the same command in this process."""
    if process:
        return await exports(world["env"], *args, cwd=world["cwd"])
    return await asyncio.to_thread(in_process, world["env"], *args)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def assert_answered(ran: Ran, code: int, *expected: str) -> str:
    """Exit status `code`, exactly one line on stderr holding `expected`, no traceback, no control character."""
    assert ran.code == code, ran
    assert "Traceback" not in ran.stderr and "Traceback" not in ran.stdout, ran
    lines = ran.stderr.splitlines()
    assert len(lines) == 1, ran
    assert not CONTROL.search(ran.stderr.rstrip("\n")), ran
    for text in expected:
        assert text in lines[0], (text, ran)
    return lines[0]


async def snapshot(db) -> dict[str, object]:
    counts = {t: await db.admin.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
    rows = await db.admin.fetch("SELECT id, status, version, destination_id, created_by FROM export_jobs ORDER BY id")
    return {**counts, "jobs": [tuple(r) for r in rows]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens: connections are refused."""
    return free_port()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that completes the TCP handshake (the kernel does) and then never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


@pytest.fixture
async def world(db, store, temporal_env, tmp_path):
    tenant_id, destination_id = await seed_tenant(db.admin)
    _, other_destination = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    failed_id = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, failed_id, Status.FAILED, FailureCode.BUILD_FAILED)
    env = {f"EXPORTS_{k.upper()}": v for k, v in db.server.urls(db.name).items()}
    env["EXPORTS_TEMPORAL_ADDRESS"] = temporal_env.client.service_client.config.target_host
    return {"db": db, "env": env, "cwd": tmp_path, "tenant": str(tenant_id), "destination": str(destination_id),
            "other_destination": str(other_destination), "job": str(job_id), "failed": str(failed_id),
            "attempt": str(attempt)}


def commands(w: dict, job: str | None = None) -> dict[str, list[str]]:
    """One well-formed invocation of every command that touches PostgreSQL."""
    job = job or w["job"]
    return {
        "show": ["show", job],
        "create": ["create", "--tenant", w["tenant"], "--destination", w["destination"], "--created-by", "op"],
        "cancel": ["cancel", job, "--tenant", w["tenant"], "--operator", "op", "--reason", "why"],
        "edit": ["edit", job, "--tenant", w["tenant"], "--version", "1", "--destination", w["destination"]],
        "replace": ["replace", w["failed"], "--tenant", w["tenant"], "--created-by", "op", "--reason", "why"],
        "reconcile": ["reconcile", job, "--tenant", w["tenant"], "--attempt", w["attempt"], "--outcome", "Completed",
                      "--by", "op", "--evidence", "seen"],
        "correct": ["correct", w["failed"], "--tenant", w["tenant"], "--attempt", w["attempt"], "--from", "Failed",
                    "--to", "Completed", "--by", "op", "--evidence", "ticket", "--why", "it arrived"],
        "list": ["list", "--tenant", w["tenant"]],
        "migrate": ["migrate"],
    }


def postgres_at(port: int) -> dict[str, str]:
    url = f"postgresql+asyncpg://exports_app@127.0.0.1:{port}/exports"
    return {f"EXPORTS_{name}_URL": url for name in ("DATABASE", "DISPATCHER_DATABASE", "RECONCILIATION_DATABASE",
                                                    "OWNER_DATABASE")}


# --- unreachable components: exit status 5, within a bound --------------------------------------------------------


@pytest.mark.parametrize("command", list(commands({"tenant": "t", "destination": "d", "job": "j", "failed": "f",
                                                   "attempt": "a"})))
async def test_an_unreachable_postgresql_is_one_line_and_exit_5(world, closed_port, command):
    args = commands(world)[command]
    ran = await exports({**world["env"], **postgres_at(closed_port)}, *args, cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_UNREACHABLE, "PostgreSQL")
    assert ran.seconds < ANSWER_BOUND, ran


async def test_a_silent_postgresql_is_answered_within_the_connection_bound(world, silent_port):
    before = await snapshot(world["db"])
    ran = await exports({**world["env"], **postgres_at(silent_port)}, *commands(world)["create"], cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_UNREACHABLE, "PostgreSQL", "no answer within 5 s")
    assert ran.seconds < ANSWER_BOUND, ran
    assert await snapshot(world["db"]) == before


@pytest.mark.parametrize("command", [["list"], ["schedules", "install"], ["worker"]])
async def test_an_unreachable_temporal_is_one_line_exit_5_and_writes_nothing(world, closed_port, command):
    args = {"list": commands(world)["list"]}.get(command[0], command)
    before = await snapshot(world["db"])
    ran = await exports({**world["env"], "EXPORTS_TEMPORAL_ADDRESS": f"127.0.0.1:{closed_port}",
                         "EXPORTS_TASK_QUEUE": f"hi6-{uuid.uuid4().hex[:8]}"}, *args, cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_UNREACHABLE, "Temporal")
    assert ran.seconds < ANSWER_BOUND, ran
    assert await snapshot(world["db"]) == before


async def test_a_silent_temporal_is_answered_within_the_connection_bound(world, silent_port):
    before = await snapshot(world["db"])
    ran = await exports({**world["env"], "EXPORTS_TEMPORAL_ADDRESS": f"127.0.0.1:{silent_port}"},
                        *commands(world)["list"], cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_UNREACHABLE, "Temporal", "no answer within 5 s")
    assert ran.seconds < ANSWER_BOUND, ran
    assert await snapshot(world["db"]) == before


@pytest.mark.spec("OU1")
@pytest.mark.parametrize("temporal", ["closed", "silent"])
async def test_a_cancel_is_recorded_in_the_row_whether_or_not_temporal_answers(world, closed_port, silent_port,
                                                                            temporal):
    """The row is the authority: `exports cancel` writes it first, then signals as best it can, and says which."""
    port = closed_port if temporal == "closed" else silent_port
    ran = await exports({**world["env"], "EXPORTS_TEMPORAL_ADDRESS": f"127.0.0.1:{port}"},
                        *commands(world)["cancel"], cwd=world["cwd"])
    assert ran.code == 0, ran
    assert ran.stdout.startswith("CanceledWhileQueued (request "), ran
    warnings = ran.stderr.strip().splitlines()
    assert len(warnings) == 1 and "is recorded, but the workflow was not signalled" in warnings[0], ran
    assert "Traceback" not in ran.stderr
    assert ran.seconds < ANSWER_BOUND, ran
    row = await world["db"].admin.fetchrow("SELECT status, cancellation_request_id FROM export_jobs WHERE id = $1",
                                           uuid.UUID(world["job"]))
    assert row["status"] == "Canceled" and row["cancellation_request_id"] is not None
    assert await world["db"].admin.fetchval("SELECT count(*) FROM cancellation_requests") == 1


@pytest.mark.parametrize("variable, value", [
    ("EXPORTS_DATABASE_URL", ""),
    ("EXPORTS_DATABASE_URL", "not a url"),
    ("EXPORTS_DATABASE_URL", "postgresql://exports_app@127.0.0.1/exports"),
    ("EXPORTS_TEMPORAL_ADDRESS", "not an address"),
])
async def test_a_missing_or_unusable_address_is_one_line_and_exit_5(world, variable, value):
    args = commands(world)["list" if "TEMPORAL" in variable else "create"]
    before = await snapshot(world["db"])
    ran = await exports({**world["env"], variable: value}, *args, cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_UNREACHABLE, variable)
    assert await snapshot(world["db"]) == before


async def test_a_malformed_setting_is_one_line_and_exit_2(world):
    ran = await exports({**world["env"], "EXPORTS_LEASE_SECONDS": "soon"}, "show", world["job"], cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_BAD_INPUT, "EXPORTS_LEASE_SECONDS")


# --- numbers and malformed values: exit status 2 ------------------------------------------------------------------


@pytest.mark.parametrize("version", ["99999999999", str(INT4_MAX + 1), "-1", "0", "abc", "1.5", "", "1e3",
                                     "99999999999999999999999999999999"])
async def test_an_edit_version_outside_what_the_column_stores_is_bad_input(world, version):
    before = await snapshot(world["db"])
    ran = await run(world, "edit", world["job"], "--tenant", world["tenant"], "--version", version,
                    "--destination", world["destination"], process=version == "99999999999")
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ", "version")
    assert await snapshot(world["db"]) == before


async def test_the_largest_storable_version_is_asked_and_answered_not_changed(world):
    ran = await exports(world["env"], "edit", world["job"], "--tenant", world["tenant"], "--version",
                        str(INT4_MAX), "--destination", world["destination"], cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_NOT_DONE, "not changed")


@pytest.mark.parametrize("limit", ["0", "1001", "-5", "99999999999999999999", "many"])
async def test_a_list_limit_out_of_range_is_bad_input(world, limit):
    ran = await run(world, "list", "--limit", limit, process=limit == "0")
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ", "limit")


@pytest.mark.parametrize("args", [
    ["nosuchcommand"],
    ["create", "--tenant", "t"],
    ["show"],
    ["show", "x", "--no-such-option"],
    ["cancel", "x", "--tenant"],
    ["list", "--status", "Sleeping"],
    ["schedules", "remove"],
], ids=lambda a: " ".join(a))
async def test_malformed_command_lines_are_one_line_and_exit_2(world, args):
    before = await snapshot(world["db"])
    ran = await run(world, *args, process=args == ["create", "--tenant", "t"])
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ")
    assert await snapshot(world["db"]) == before


async def test_help_still_prints_and_exits_0(world):
    ran = await run(world, "--help", process=False)
    assert ran.code == 0 and "cancel" in ran.stdout and ran.stderr == "", ran
    ran = await exports(world["env"], cwd=world["cwd"])
    assert ran.code == 0 and "cancel" in ran.stdout and ran.stderr == "", ran


# --- operator text: blank, NUL, not UTF-8, control characters, over-long: exit status 2 -------------------------


def text_options(w: dict) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Every command's operator-typed text options, each with a value that is accepted."""
    return {
        "create": (["create", "--tenant", w["tenant"], "--destination", w["destination"]],
                   {"--created-by": "op"}),
        "cancel": (["cancel", w["job"], "--tenant", w["tenant"]], {"--operator": "op", "--reason": "why"}),
        "replace": (["replace", w["failed"], "--tenant", w["tenant"]],
                    {"--created-by": "op", "--reason": "why", "--overwrite-agreement": "agreement 7"}),
        "reconcile": (["reconcile", w["job"], "--tenant", w["tenant"], "--attempt", w["attempt"],
                       "--outcome", "Completed"], {"--by": "op", "--evidence": "seen"}),
        "correct": (["correct", w["failed"], "--tenant", w["tenant"], "--attempt", w["attempt"], "--from", "Failed",
                     "--to", "Completed"], {"--by": "op", "--evidence": "ticket", "--why": "it arrived"}),
    }


def with_value(w: dict, command: str, option: str, value: str | bytes) -> list[str | bytes]:
    fixed, options = text_options(w)[command]
    args: list[str | bytes] = list(fixed)
    for name, good in options.items():
        args += [name, value if name == option else good]
    return args


def each_text_option() -> list[tuple[str, str]]:
    fake = {"tenant": "t", "destination": "d", "job": "j", "failed": "f", "attempt": "a"}
    return [(command, option) for command, (_, options) in text_options(fake).items() for option in options]


LONG = {"--created-by": 201, "--operator": 201, "--by": 201, "--overwrite-agreement": 201}  # MAX_NAME + 1


@pytest.mark.parametrize("command, option", each_text_option())
async def test_hostile_operator_text_is_bad_input_and_writes_nothing(world, command, option):
    """Blank, over-long and terminal escapes, for every text option of every command."""
    before = await snapshot(world["db"])
    for value in ["   ", "\t", "\n", "x" * LONG.get(option, 2001), "ok\x1b[2J\x1b]0;owned\x07", "ok\x9b31m"]:
        ran = await run(world, *with_value(world, command, option, value), process=False)
        assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ")
    assert await snapshot(world["db"]) == before


@pytest.mark.parametrize("command", list(text_options({"tenant": "t", "destination": "d", "job": "j", "failed": "f",
                                                       "attempt": "a"})))
async def test_operator_text_that_is_not_utf8_is_bad_input(world, command):
    """Bytes that are not UTF-8 on the command line (Python hands them over as lone surrogates)."""
    before = await snapshot(world["db"])
    _, options = text_options(world)[command]
    ran = await exports(world["env"], *with_value(world, command, next(iter(options)), b"ok\xff\xfe"),
                        cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ", "UTF-8")
    assert await snapshot(world["db"]) == before


@pytest.mark.parametrize("command, option", each_text_option())
async def test_a_nul_byte_in_any_text_option_is_bad_input(world, command, option):
    """No command line can carry a NUL byte (execve ends each argument at one): the command object is called in
    this process instead, as a wrapper script would."""
    before = await snapshot(world["db"])
    ran = await asyncio.to_thread(in_process, world["env"], *with_value(world, command, option, "ann\x00b"))
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ")
    assert await snapshot(world["db"]) == before


# --- refusals by the database: exit status 4 ------------------------------------------------------------------


async def test_a_correction_under_a_role_that_may_not_correct_is_refused_with_exit_4(world):
    before = await snapshot(world["db"])
    env = {**world["env"], "EXPORTS_RECONCILIATION_DATABASE_URL": world["db"].url("app")}
    ran = await exports(env, *commands(world)["correct"], cwd=world["cwd"])
    assert_answered(ran, exits.EXIT_REFUSED, "refused")
    assert await snapshot(world["db"]) == before


def test_the_readme_documents_every_exit_status():
    readme = (ROOT / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if p.startswith("Bad input ("))
    flat = " ".join(paragraph.split()).lower()
    codes = {name: value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    assert set(codes.values()) >= {2, 3, 4, 5}, codes
    for name, code in codes.items():
        assert f"exit status {code}" in flat, (name, code, paragraph)


# --- operator text is printed literally ---------------------------------------------------------------------


MARKUP = "[/] [b red]loud[/] [link=x]y[/link] :smile: [/nope]"  # short enough for a table at 80 columns


async def test_markup_typed_by_an_operator_is_printed_literally(world):
    created = await run(world, "create", "--tenant", world["tenant"], "--destination", world["destination"],
                        "--created-by", MARKUP, process=True)
    assert created.code == 0, created
    job = created.stdout.strip()
    canceled = await run(world, "cancel", job, "--tenant", world["tenant"], "--operator", "[/]ann",
                         "--reason", MARKUP, process=False)
    assert canceled.code == 0, canceled
    replaced = await run(world, "replace", world["failed"], "--tenant", world["tenant"], "--created-by", "[b]op",
                         "--reason", MARKUP, process=False)
    assert replaced.code == 0, replaced
    for shown_job, literal, process in ((job, MARKUP, True), (job, "[/]ann", False),
                                        (replaced.stdout.strip(), MARKUP, False)):
        shown = await run(world, "show", shown_job, process=process)
        assert shown.code == 0 and shown.stderr == "", shown
        assert literal in shown.stdout, shown


async def test_control_characters_already_stored_are_shown_as_escapes(world):
    """Text that reached the database another way (an older version, a raw Temporal signal, SQL): `show` never
    sends its control characters to the terminal."""
    hostile = "ann\x1b[2J\x1b]0;owned\x07\x9b31m\rbob\x08\u202e"
    await world["db"].admin.execute("UPDATE export_jobs SET created_by = $1 WHERE id = $2", hostile,
                                    uuid.UUID(world["job"]))
    await world["db"].admin.execute(
        "INSERT INTO cancellation_requests (id, tenant_id, job_id, requested_by, reason, outcome, found_status, "
        "found_attempt_count) VALUES ($1, $2, $3, $4, $4, 'NotCancelable', 'Queued', 0)",
        uuid.uuid4(), uuid.UUID(world["tenant"]), uuid.UUID(world["job"]), hostile)
    shown = await exports(world["env"], "show", world["job"], cwd=world["cwd"])
    assert shown.code == 0 and shown.stderr == "", shown
    assert not CONTROL.search(shown.stdout.replace("\n", "")), shown
    assert "\u202e" not in shown.stdout, shown
    assert r"ann\x1b[2J\x1b]0;owned\x07\x9b31m\rbob\x08\u202e" in shown.stdout, shown
    as_json = await run(world, "show", world["job"], "--json", process=False)
    assert as_json.code == 0 and not CONTROL.search(as_json.stdout.replace("\n", "")), as_json


async def test_hostile_ids_in_error_lines_are_escaped(world):
    ran = await exports(world["env"], "show", "\x1b[2J\x1b]0;owned\x07" + "9" * 500, cwd=world["cwd"])
    line = assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ", r"\x1b[2J")
    assert len(line) < 300, line
    ran = await run(world, "edit", world["job"], "--tenant", world["tenant"], "--version", "\x1b[2J",
                    "--destination", world["destination"], process=False)
    assert_answered(ran, exits.EXIT_BAD_INPUT, "error: ", "--version")


# --- arbitrary text, per command: an answer of the documented kind, never a traceback -------------------------


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "[/]", "\x1b[2J", "x" * 201, "y" * 2001, "\ud800", "ann@example.com"])
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def acceptable(option: str, value: str) -> bool:
    """What the commands accept as operator text: not blank, within its column's agreed length, valid UTF-8, and
    no control character but tab and newline."""
    limit = LONG.get(option, 2001) - 1
    return (bool(value.strip()) and len(value) <= limit
            and not any(unicodedata.category(c) in ("Cc", "Cs") and c not in "\t\n" for c in value))


def assert_documented(ran: Ran) -> None:
    assert ran.code in (0, exits.EXIT_BAD_INPUT, exits.EXIT_NOT_DONE), ran
    assert "Traceback" not in ran.stderr + ran.stdout, ran
    assert not CONTROL.search(ran.stdout.replace("\n", "")), ran
    if ran.code != 0:
        assert len(ran.stderr.splitlines()) == 1 and not CONTROL.search(ran.stderr.rstrip("\n")), ran


@pytest.mark.parametrize("command", list(text_options({"tenant": "t", "destination": "d", "job": "j", "failed": "f",
                                                       "attempt": "a"})))
@PROPERTY
@given(data=st.data())
async def test_arbitrary_operator_text_gets_a_documented_answer(world, command, data):
    _, options = text_options(world)[command]
    values = {option: data.draw(ANY_TEXT, label=option) for option in options}
    fixed, _ = text_options(world)[command]
    args = list(fixed) + [item for pair in values.items() for item in pair]
    before = await snapshot(world["db"])
    ran = await asyncio.to_thread(in_process, world["env"], *args)
    assert_documented(ran)
    if not all(acceptable(option, value) for option, value in values.items()):
        assert ran.code == exits.EXIT_BAD_INPUT, (values, ran)
    elif ran.code == exits.EXIT_BAD_INPUT:  # a second replacement of the same original, only
        assert command == "replace" and "already has" in ran.stderr, (values, ran)
    if ran.code != 0:
        assert await snapshot(world["db"]) == before
    elif command == "create":
        job = ran.stdout.strip()
        shown = await asyncio.to_thread(in_process, world["env"], "show", job)
        assert_documented(shown)
        assert shown.code == 0
        stored = await world["db"].admin.fetchval("SELECT created_by FROM export_jobs WHERE id = $1",
                                                  uuid.UUID(job))
        assert stored == values["--created-by"]


@PROPERTY
@given(job=ANY_TEXT, tenant=ANY_TEXT, version=st.one_of(st.integers(), ANY_TEXT.map(str)))
async def test_arbitrary_ids_and_numbers_get_a_documented_answer(world, job, tenant, version):
    before = await snapshot(world["db"])
    version_before = await world["db"].admin.fetchval("SELECT version FROM export_jobs WHERE id = $1",
                                                      uuid.UUID(world["job"]))
    for args in (["show", job, "--tenant", tenant],
                 ["edit", job, "--tenant", tenant, "--version", str(version), "--destination", world["destination"]],
                 ["edit", world["job"], "--tenant", world["tenant"], "--version", str(version),
                  "--destination", world["destination"]]):
        ran = await asyncio.to_thread(in_process, world["env"], *args)
        assert_documented(ran)
    if await snapshot(world["db"]) != before:  # only the well-formed edit at the row's version changes it
        assert int(str(version)) == version_before, version


# --- a cancellation recorded whose signal Temporal did not take -----------------------------------------------


class _Unavailable:
    """A Temporal client whose signal finds the server gone, after the cancellation was recorded."""

    def get_workflow_handle(self, workflow_id: str) -> _Unavailable:
        return self

    async def signal(self, name: str, payload: object) -> None:
        raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")


async def test_a_recorded_cancellation_whose_signal_failed_says_so_in_one_line(world, store):
    exports_client = ExportsClient(store, _Unavailable())
    with pytest.raises(SignalNotSent) as raised:
        await exports_client.cancel(tenant_id=world["tenant"], job_id=world["job"], requested_by="op")
    request_id = raised.value.result.request_id
    assert await world["db"].admin.fetchval("SELECT outcome FROM cancellation_requests WHERE id = $1",
                                            request_id) == "CanceledWhileQueued"
    code, line = exits.answer(raised.value)
    assert code == exits.EXIT_UNREACHABLE and "\n" not in line, line
    assert "recorded" in line and f"--request-id {request_id}" in line, line

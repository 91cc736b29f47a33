"""Case PT5, the URL part: a database URL naming a primary and a standby, in each of the forms libpq, asyncpg or
SQLAlchemy document, reaches whichever host answers, for every role (the engines, alembic's migrations as the
owner, the raw connections of COPY and LISTEN, the command line and the worker), with `target_session_attrs`
passed to the driver. A form that cannot be read without dropping a host is refused before anything connects:
one line naming the setting and the form that works, exit status 2 (README, "a malformed EXPORTS_* setting").

Real components: the suite's PostgreSQL, reached over TCP through a pass-through proxy on 127.0.0.1 (the embedded
server listens on its Unix socket only), and a free port nobody listens on as the other host; `exports` and
`python -m worker` as processes, with the suite's Temporal dev server."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from starter.localstack.ports import free_port
from store import urls
from store.db import asyncpg_dsn, connect_raw, head_revision, make_engine, migrate
from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.harness import WorkerProcess
from tests.helpers.support import create_job, eventually, exports_command, seed_tenant

BOUND = 20.0  # seconds, for every connection, statement and notification here
COMMAND_BOUND = 60.0  # seconds, for every process these tests run

Host = tuple[str, int]

# The multi-host forms, each as its documentation writes it (user, hosts, database, query left to fill in).
FORMS = {
    # libpq's URI: every host with its port, before the path.
    "hosts-in-authority": lambda auth, hosts, db, q: (
        f"postgresql+asyncpg://{auth}@{','.join(f'{h}:{p}' for h, p in hosts)}/{db}?{q}"),
    # libpq's keywords as query parameters: a list of hosts and a list of ports.
    "host-and-port-lists": lambda auth, hosts, db, q: (
        f"postgresql+asyncpg://{auth}@/{db}?host={','.join(h for h, _ in hosts)}"
        f"&port={','.join(str(p) for _, p in hosts)}&{q}"),
    # SQLAlchemy's asyncpg multihost form: host=h:p repeated.
    "repeated-host": lambda auth, hosts, db, q: (
        f"postgresql+asyncpg://{auth}@/{db}?{'&'.join(f'host={h}:{p}' for h, p in hosts)}&{q}"),
    # asyncpg's reading of a host list in the query: h:p, comma-separated.
    "host-port-list": lambda auth, hosts, db, q: (
        f"postgresql+asyncpg://{auth}@/{db}?host={','.join(f'{h}:{p}' for h, p in hosts)}&{q}"),
}
READ_WRITE = "target_session_attrs=read-write"


@pytest.fixture
async def live(pg_server) -> AsyncIterator[PgFaultProxy]:
    """The suite's PostgreSQL on a TCP port of 127.0.0.1: a proxy that only forwards (no fault is armed)."""
    async with fault_proxy(pg_server) as proxy:
        yield proxy


def dead() -> Host:
    """A TCP port on 127.0.0.1 that nobody listens on: a primary that is down."""
    return ("127.0.0.1", free_port())


def multi_host_url(db, role: str, form: str, hosts: list[Host], query: str = READ_WRITE) -> str:
    """The role's URL of the test's database (its user and password as the suite gives them), in `form`."""
    base = make_url(db.url(role))
    auth = quote(base.username or "", safe="")
    if base.password:
        auth += ":" + quote(base.password, safe="")
    return FORMS[form](auth, hosts, base.database, query)


def user_of(db, role: str) -> str:
    return make_url(db.url(role)).username or ""


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


# --- every role, in every form, with the first host down (and then the second) ------------------------------------

@pytest.mark.spec("PT5")
@pytest.mark.parametrize("order", ["down-first", "down-second"])
@pytest.mark.parametrize("form", sorted(FORMS))
async def test_each_multi_host_form_reaches_the_host_that_answers_for_every_role(db, live, form: str, order: str):
    hosts = [dead(), ("127.0.0.1", live.port)]
    if order == "down-second":
        hosts.reverse()  # a reading that kept only the last host (or only the first) fails one of the two orders
    for role in ("app", "dispatcher", "reconciler"):
        url = multi_host_url(db, role, form, hosts)
        engine = make_engine(url)
        try:
            # The address in messages names both hosts, not one of them.
            address = engine.url.render_as_string(hide_password=True)
            assert all(str(port) in address for _, port in hosts), address
            async with asyncio.timeout(BOUND):
                async with engine.connect() as conn:
                    assert await conn.scalar(text("SELECT current_user")) == user_of(db, role)
                    assert await conn.scalar(text("SELECT current_database()")) == db.name
                    # read-write found the primary: a session that may write.
                    assert await conn.scalar(text("SHOW transaction_read_only")) == "off"
        finally:
            await engine.dispose()

    # The owner, through alembic: the test's database is at the head already, so nothing changes.
    before, after = await asyncio.wait_for(migrate(multi_host_url(db, "owner", form, hosts)), BOUND)
    assert before == after == head_revision()

    # The raw connections a build and the dispatcher open: LISTEN hears a NOTIFY, COPY streams rows.
    raw = await asyncio.wait_for(connect_raw(multi_host_url(db, "app", form, hosts)), BOUND)
    try:
        heard: asyncio.Queue[str] = asyncio.Queue()
        await raw.add_listener("pt5_failover", lambda _c, _pid, _channel, payload: heard.put_nowait(payload))
        await db.admin.execute("NOTIFY pt5_failover, 'wake up'")
        assert await asyncio.wait_for(heard.get(), BOUND) == "wake up"
        out = io.BytesIO()
        await asyncio.wait_for(raw.copy_from_query("SELECT g FROM generate_series(1, 3) g", output=out), BOUND)
        assert out.getvalue() == b"1\n2\n3\n"
    finally:
        await asyncio.wait_for(raw.close(), BOUND)


@pytest.mark.spec("PT5")
@pytest.mark.parametrize("form", sorted(FORMS))
async def test_target_session_attrs_reaches_the_driver_in_each_form(db, live, form: str):
    """Asked for a standby where both hosts are the primary, no host qualifies: the attribute was not dropped.
    (Both hosts answer: with one down, asyncpg reports that host's refusal instead.)"""
    url = multi_host_url(db, "app", form, [("127.0.0.1", live.port)] * 2, "target_session_attrs=standby")
    with pytest.raises(Exception, match="target attribute requirement .*standby"):
        await asyncio.wait_for(connect_raw(url), BOUND)
    engine = make_engine(url)
    try:
        with pytest.raises(Exception, match="target attribute requirement .*standby"):
            async with asyncio.timeout(BOUND):
                async with engine.connect():
                    pass
    finally:
        await engine.dispose()


# --- the command line ---------------------------------------------------------------------------------------------

@pytest.mark.spec("PT5")
@pytest.mark.parametrize("form", sorted(FORMS))
async def test_the_command_line_accepts_each_form_for_the_application_owner_and_reconciliation_roles(
        db, store, live, form: str, tmp_path: Path):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    hosts = [dead(), ("127.0.0.1", live.port)]
    settings = db.settings(database_url=multi_host_url(db, "app", form, hosts),
                           reconciliation_database_url=multi_host_url(db, "reconciler", form, hosts),
                           owner_database_url=multi_host_url(db, "owner", form, hosts))

    shown = await exports_command(settings, "show", str(job_id), "--json", cwd=tmp_path, bound=COMMAND_BOUND)
    assert shown.code == 0, shown
    assert str(job_id) in shown.stdout and "Queued" in shown.stdout, shown

    migrated = await exports_command(settings, "migrate", cwd=tmp_path, bound=COMMAND_BOUND)
    assert migrated.code == 0, migrated
    assert f"already at {head_revision()}" in migrated.stdout, migrated

    # The reconciliation role connects and runs its statement: the export is not OutcomeUnknown, so exit 3.
    reconciled = await exports_command(settings, "reconcile", str(job_id), "--tenant", str(tenant_id),
                                       "--attempt", str(uuid.uuid4()), "--outcome", "Completed", "--by", "pt5",
                                       "--evidence", "a test", cwd=tmp_path, bound=COMMAND_BOUND)
    assert reconciled.code == 3 and "not reconciled" in reconciled.stderr, reconciled


# Forms that would lose a host, or a setting, if they were read at all. Nothing listens at 127.0.0.1:1 or :2, so
# a URL that slipped through would end in "unreachable" (exit 5), not exit 2.
MALFORMED = {
    "a port that is not a number": "postgresql+asyncpg://exports_app@127.0.0.1:1,127.0.0.1:five/exports",
    "a port out of range": "postgresql+asyncpg://exports_app@127.0.0.1:1,127.0.0.1:70000/exports",
    "an empty host in the list": "postgresql+asyncpg://exports_app@127.0.0.1:1,,127.0.0.1:2/exports",
    "hosts before the path and in ?host=":
        "postgresql+asyncpg://exports_app@127.0.0.1:1/exports?host=127.0.0.1:2",
    "ports after the hosts and in ?port=":
        "postgresql+asyncpg://exports_app@/exports?host=127.0.0.1:1,127.0.0.1&port=2",
    "more ports than hosts": "postgresql+asyncpg://exports_app@/exports?host=127.0.0.1,127.0.0.1&port=1,2,3",
    "a port list that is not numbers": "postgresql+asyncpg://exports_app@/exports?host=127.0.0.1&port=one",
    "an unknown target_session_attrs":
        "postgresql+asyncpg://exports_app@127.0.0.1:1,127.0.0.1:2/exports?target_session_attrs=primary-ish",
    "target_session_attrs twice": "postgresql+asyncpg://exports_app@127.0.0.1:1,127.0.0.1:2/exports"
                                  "?target_session_attrs=read-write&target_session_attrs=any",
}
THE_FORM_THAT_WORKS = "postgresql+asyncpg://user@host1:port1,host2:port2/database?target_session_attrs=read-write"


@pytest.mark.spec("PT5")
@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_multi_host_url_that_cannot_be_read_whole_is_one_line_and_exit_2(case: str, db, tmp_path: Path):
    url = MALFORMED[case]
    with pytest.raises(ValueError, match="host1:port1,host2:port2"):
        asyncpg_dsn(url)
    with pytest.raises(ValueError, match="host1:port1,host2:port2"):
        make_engine(url)
    for setting, command in (("EXPORTS_DATABASE_URL", ("show", str(uuid.uuid4()))),
                             ("EXPORTS_DATABASE_URL", ("destinations", "list")),
                             ("EXPORTS_OWNER_DATABASE_URL", ("migrate",))):
        field = setting.removeprefix("EXPORTS_").lower()
        # model_copy: the test's own Settings would refuse the URL as the command's do.
        ran = await exports_command(db.settings().model_copy(update={field: url}), *command, cwd=tmp_path,
                                    bound=COMMAND_BOUND)
        assert ran.code == 2, (case, ran)
        line = one_line(ran.stderr)
        assert line.startswith(f"error: setting {setting}: "), line
        assert THE_FORM_THAT_WORKS in line, line


@pytest.mark.spec("PT5")
def test_a_url_with_one_host_is_handed_on_as_written_and_a_repeated_host_keeps_every_host():
    for url in ("postgresql+asyncpg://u:p%40ss@db.example:5433/exports?sslmode=verify-full",
                "postgresql+asyncpg://u@/exports?host=/run/postgresql", "postgresql+asyncpg://u@[::1]:5432/exports",
                "postgresql+asyncpg://exports_dispatcher@"):
        assert urls.sqlalchemy_url(url) == url
        assert asyncpg_dsn(url) == url.replace("postgresql+asyncpg://", "postgresql://")
    # asyncpg alone would keep only the last of a repeated host=, and ignore ?port= beside hosts before the path.
    assert asyncpg_dsn("postgresql+asyncpg://u@/exports?host=a:1&host=b:2&target_session_attrs=read-write") == \
        "postgresql://u@/exports?host=a:1,b:2&target_session_attrs=read-write"
    assert asyncpg_dsn("postgresql+asyncpg://u@a,b/exports?port=5433") == "postgresql://u@/exports?host=a,b&port=5433"


# --- the worker ---------------------------------------------------------------------------------------------------

async def _log_of(worker: WorkerProcess) -> str:
    return worker.log_path.read_text() if worker.log_path.exists() else ""


@pytest.mark.spec("PT5")
async def test_a_worker_on_multi_host_urls_polls_and_listens_past_a_host_that_is_down(db, client, live,
                                                                                       tmp_path: Path):
    hosts = [dead(), ("127.0.0.1", live.port)]
    settings = db.settings(temporal_address=client.service_client.config.target_host,
                           task_queue=f"pt5-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work",
                           database_url=multi_host_url(db, "app", "hosts-in-authority", hosts),
                           dispatcher_database_url=multi_host_url(db, "dispatcher", "repeated-host", hosts))
    worker = await WorkerProcess(settings).start()
    try:
        log = await eventually(lambda: _log_of(worker), lambda text: "polling" in text or worker.process.returncode
                               is not None, timeout=COMMAND_BOUND, what="the worker polling (or exiting)")
        assert worker.process.returncode is None, log
        # The dispatcher's LISTEN found the server as well (a backend of its role that ran LISTEN): it is not left
        # polling only.
        await eventually(lambda: db.admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND usename = $2 AND query ILIKE 'LISTEN%'",
            db.name, user_of(db, "dispatcher")), lambda found: found >= 1, timeout=BOUND,
            what="the dispatcher's LISTEN on the server")
        log = await _log_of(worker)
        assert "polling only" not in log and "Traceback" not in log, log
    finally:
        await worker.stop()
    assert worker.process.returncode == 0, await _log_of(worker)


@pytest.mark.spec("PT5")
async def test_a_worker_given_a_multi_host_url_it_cannot_read_whole_exits_2_naming_the_form(db, client,
                                                                                          tmp_path: Path):
    settings = db.settings(temporal_address=client.service_client.config.target_host,
                           task_queue=f"pt5-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work",
                           http_port=free_port()).model_copy(
        update={"database_url": MALFORMED["hosts before the path and in ?host="]})
    worker = await WorkerProcess(settings).start()
    try:
        code = await asyncio.wait_for(worker.process.wait(), COMMAND_BOUND)
    finally:
        await worker.stop()
    log = await _log_of(worker)
    assert code == 2, log
    assert "Traceback" not in log and "polling" not in log, log
    problems = [line for line in log.splitlines() if "EXPORTS_DATABASE_URL" in line]
    assert len(problems) == 1 and THE_FORM_THAT_WORKS in problems[0], log


@pytest.mark.spec("PT5")
def test_each_host__every_form_gives_each_host_alone_with_its_port_and_the_other_parameters():
    """The URLs a connect tries one host at a time (store/db.py, connect_each_host), from each multi-host form."""
    expected = ["postgresql://u@/db?host=a&port=5433&target_session_attrs=read-write",
                "postgresql://u@/db?host=b&port=5434&target_session_attrs=read-write"]
    for url in ("postgresql://u@a:5433,b:5434/db?target_session_attrs=read-write",
                "postgresql://u@/db?host=a,b&port=5433,5434&target_session_attrs=read-write",
                "postgresql://u@/db?host=a:5433&host=b:5434&target_session_attrs=read-write",
                "postgresql://u@/db?host=a:5433,b:5434&target_session_attrs=read-write"):
        assert urls.each_host(url) == expected, url
    assert urls.each_host("postgresql://u@/db?host=a,b&port=5433&sslmode=require") == [
        "postgresql://u@/db?host=a&port=5433&sslmode=require", "postgresql://u@/db?host=b&port=5433&sslmode=require"]
    assert urls.each_host("postgresql://u@/db?host=/run/a,/run/b") == [
        "postgresql://u@/db?host=/run/a", "postgresql://u@/db?host=/run/b"]
    one = "postgresql://u@a:5433/db?sslmode=require"
    assert urls.each_host(one) == [one]

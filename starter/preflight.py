"""What a worker checks at start, before it takes any task (case UP4): that the Temporal namespace has every search
attribute this release sets, with its type; that the database is at the schema revision this release ships; and
that the database roles the worker connects as have the privileges it uses. Whatever is missing is one line each,
naming it and the command that adds it, and the worker exits with status 2 having polled nothing. Without it, a
missing search attribute failed every new export's workflow task after its claim had committed.

Reaching Temporal or PostgreSQL is not a check: the worker waits for Temporal before this runs, and a database that
does not answer at start defers the database checks until it does (no step can commit anything meanwhile), as the
worker has always started during a database outage (case OU2). `exports setup` registers the search attributes
(`register_search_attributes`), and `exports migrate` applies the schema and the grants (`grant_statements`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import asyncpg
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import CountWorkflowExecutionsRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.process.temporal import CONNECT_TIMEOUT_SECONDS, short_reason, temporal_target
from store import errors
from store.db import (
    asyncpg_dsn,
    database_revision,
    head_revision,
    known_revisions,
    newer_revision_line,
    revision_module,
)
from store.settings import Settings
from workflows.identity import SEARCH_ATTRIBUTES

log = logging.getLogger("exports.preflight")

# Where the search attributes cannot be listed or queried by the worker's credentials (a Temporal Cloud API key
# that may do neither), an operator who checked them another way starts the worker with this set (Settings).
SKIP_SETTING = "EXPORTS_PREFLIGHT_SKIP"

_RPC_TIMEOUT = timedelta(seconds=CONNECT_TIMEOUT_SECONDS)
# Answers that may differ a moment later: the start waits and asks again, as it waits for Temporal to connect.
_TEMPORAL_AWAY = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED,
                  RPCStatusCode.ABORTED, RPCStatusCode.INTERNAL, RPCStatusCode.UNKNOWN, RPCStatusCode.CANCELLED)
# What a caller who may not administer the namespace gets (Temporal Cloud answers UNIMPLEMENTED for some).
NOT_ALLOWED = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED)


class PreflightFailed(Exception):
    """The start found problems (each logged already, one line each): the worker exits with status 2."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{len(problems)} preflight problem(s)")
        self.problems = problems


class Away(Exception):
    """Temporal or PostgreSQL did not answer the check: not a problem of the deployment, to be asked again."""


# --- search attributes ------------------------------------------------------------------------------------------


def kind_name(value: IndexedValueType.ValueType) -> str:
    """An IndexedValueType as `temporal operator search-attribute create --type` spells it (Keyword, Int, ...)."""
    return IndexedValueType.Name(value).removeprefix("INDEXED_VALUE_TYPE_").title().replace("_", "")


def expected_search_attributes() -> dict[str, str]:
    """{name: kind} of every search attribute this release's workflows set."""
    return {key.name: kind_name(IndexedValueType.ValueType(key.indexed_value_type)) for key in SEARCH_ATTRIBUTES}


def create_commands(namespace: str, attributes: dict[str, str]) -> str:
    """How to add these search attributes, with the Temporal CLI and on Temporal Cloud."""
    pairs = " ".join(f"--name {name} --type {kind}" for name, kind in attributes.items())
    cloud = " ".join(f"--search-attribute {name}={kind}" for name, kind in attributes.items())
    return (f"`temporal operator search-attribute create --namespace {namespace} {pairs}`, or on Temporal Cloud "
            f"`tcld namespace search-attributes add --namespace {namespace} {cloud}`")


class CannotList(Exception):
    """Neither the operator listing nor a visibility query would say which search attributes the namespace has."""

    def __init__(self, listing: RPCError, query: RPCError | str) -> None:
        self.listing, self.query = listing, query
        query_reason = query if isinstance(query, str) else f"{query.status.name}: {query.message}"
        super().__init__(f"listing them was refused ({listing.status.name}: {listing.message}) and so was a "
                         f"visibility query ({query_reason})")


async def registered_search_attributes(client: Client) -> dict[str, str | None]:
    """{name: the kind the namespace has it as, or None when it lacks it}, for this release's search attributes.
    From the operator service's listing; where that is refused (PERMISSION_DENIED, UNIMPLEMENTED), from a
    visibility query per attribute, which the server answers with "invalid search attribute" for one it lacks and
    names the type of one whose value does not fit. `CannotList` when both are refused; the server's other errors
    are raised as they are."""
    expected = expected_search_attributes()
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace), timeout=_RPC_TIMEOUT)
    except RPCError as exc:
        if exc.status not in NOT_ALLOWED:
            raise
        return await _queried(client, expected, exc)
    return {name: kind_name(listed.custom_attributes[name]) if name in listed.custom_attributes else None
            for name in expected}


async def _queried(client: Client, expected: dict[str, str], listing: RPCError) -> dict[str, str | None]:
    async def one(name: str, kind: str) -> str | None:
        value = "0" if kind in ("Int", "Double") else "''"
        try:
            await client.workflow_service.count_workflow_executions(
                CountWorkflowExecutionsRequest(namespace=client.namespace, query=f"{name} = {value}"),
                timeout=_RPC_TIMEOUT)
            return kind
        except RPCError as exc:
            if exc.status is not RPCStatusCode.INVALID_ARGUMENT:
                if exc.status in _TEMPORAL_AWAY:
                    raise
                raise CannotList(listing, exc) from None
            typed = re.search(rf"search attribute {re.escape(name)} of type (\w+)", exc.message)
            if typed:
                return typed.group(1)
            if re.search(rf"invalid search attribute:? {re.escape(name)}\b", exc.message):
                return None
            raise CannotList(listing, f"an answer not understood: {exc.message}") from None

    found = await asyncio.gather(*(one(name, kind) for name, kind in expected.items()))
    return dict(zip(expected, found, strict=True))


def search_attribute_problems(namespace: str, found: dict[str, str | None]) -> list[str]:
    """One line per search attribute of this release that `found` ({name: kind or None}) lacks or types otherwise."""
    problems = []
    for name, kind in expected_search_attributes().items():
        if found.get(name) is None:
            problems.append(f"Temporal namespace {namespace} lacks the search attribute {name} ({kind}), which this "
                            f"release sets: add it with {create_commands(namespace, {name: kind})}, or run "
                            f"`exports setup`")
        elif found[name] != kind:
            problems.append(wrong_type_line(namespace, name, found[name], kind))
    return problems


def wrong_type_line(namespace: str, name: str, found: str | None, kind: str) -> str:
    return (f"Temporal namespace {namespace} has the search attribute {name} as {found}, this release sets it as "
            f"{kind}: a search attribute's type cannot change; remove it (`temporal operator search-attribute "
            f"remove --namespace {namespace} --name {name}`) and run `exports setup`, or use another namespace")


async def check_search_attributes(settings: Settings, client: Client) -> list[str]:
    """The problem lines of the namespace's search attributes; `Away` when Temporal did not answer."""
    namespace = client.namespace
    try:
        found = await registered_search_attributes(client)
    except CannotList as exc:
        return [f"could not check the search attributes of Temporal namespace {namespace}: {exc}; check them "
                f"with `temporal operator search-attribute list --namespace {namespace}` (Temporal Cloud: `tcld "
                f"namespace get --namespace {namespace}`), then start the worker with "
                f"{SKIP_SETTING}=search-attributes to skip this check"]
    except RPCError as exc:
        if exc.status in _TEMPORAL_AWAY:
            raise Away(f"Temporal did not answer the search attribute check ({exc.status.name}: "
                       f"{short_reason(exc)})") from None
        if exc.status is RPCStatusCode.NOT_FOUND:
            return [f"Temporal has no namespace {namespace} ({_namespace_setting(settings)}): create it "
                    f"(`temporal operator namespace create --namespace {namespace}`) or name the right one"]
        if exc.status is RPCStatusCode.UNAUTHENTICATED:
            return [f"Temporal refused the worker's credentials ({exc.message}): check TEMPORAL_API_KEY or the "
                    f"client certificate"]
        return [f"could not check the search attributes of Temporal namespace {namespace}: {exc.status.name}: "
                f"{exc.message}"]
    return search_attribute_problems(namespace, found)


def _namespace_setting(settings: Settings) -> str:
    try:
        return temporal_target(settings).namespace_setting
    except Exception:  # noqa: BLE001 - only a message depends on it
        return "EXPORTS_TEMPORAL_NAMESPACE or TEMPORAL_NAMESPACE"


@dataclass
class Registered:
    """What `exports setup` did: the attributes it added, those registered already, those of another type."""

    added: dict[str, str] = field(default_factory=dict)
    present: dict[str, str] = field(default_factory=dict)
    conflicting: dict[str, str] = field(default_factory=dict)  # name: the kind found


async def register_search_attributes(client: Client, *, again: bool = True) -> Registered:
    """Adds this release's missing search attributes to the client's namespace; idempotent. Raises the server's
    RPCError (PERMISSION_DENIED where the caller may not administer the namespace), or `CannotList`."""
    expected = expected_search_attributes()
    found = await registered_search_attributes(client)
    done = Registered()
    for name, kind in expected.items():
        has = found[name]
        if has is None:
            done.added[name] = kind
        elif has == kind:
            done.present[name] = kind
        else:
            done.conflicting[name] = has
    if done.added:
        request = AddSearchAttributesRequest(
            namespace=client.namespace,
            search_attributes={name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
                               for name, kind in done.added.items()})
        try:
            await client.operator_service.add_search_attributes(request, timeout=_RPC_TIMEOUT)
        except RPCError as exc:
            if exc.status is not RPCStatusCode.ALREADY_EXISTS or not again:
                raise
            # Another setup added them meanwhile: say what is there now.
            return await register_search_attributes(client, again=False)
    return done


# --- the database -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    privilege: str
    table: str
    columns: tuple[str, ...] = ()  # a column grant (UPDATE of these columns only)


@dataclass(frozen=True)
class Role:
    """A role the worker connects as, the setting with its URL, and the privileges the worker uses with it."""

    name: str
    setting: str
    field: str
    grants: tuple[Grant, ...]


def _app_update_columns() -> tuple[str, ...]:
    """The export_jobs columns that migrations 0005, 0010, 0013, 0017, 0018 and 0022 let the application update
    (their APP_COLUMNS)."""
    listed = ",".join(revision_module(revision).APP_COLUMNS
                      for revision in ("0005", "0010", "0013", "0017", "0018", "0022"))
    return tuple(column.strip() for column in listed.split(","))


def worker_roles() -> tuple[Role, ...]:
    """What the worker uses of each role, as the migrations grant it at the head revision: 0001 (tables), 0005
    (the application's UPDATE narrowed to its columns, 0010's rename fence, 0013's and 0018's hand-backs, 0017's
    waiting runs and 0022's given-up cutoffs), 0009 (the evidence follow-up's looks), 0011 (partner sessions),
    0012 (the dispatcher's read of an export's tenant).
    tests/deploy/test_preflight.py compares this with the privileges a freshly migrated database holds, so a
    migration that changes a grant changes this too."""
    app = ("exports_app", "EXPORTS_DATABASE_URL", "database_url", (
        Grant("SELECT", "export_jobs"), Grant("INSERT", "export_jobs"),
        Grant("UPDATE", "export_jobs", _app_update_columns()),
        *(Grant(privilege, table) for table in ("deliveries", "export_attempt_events", "cancellation_requests",
                                                "outbox") for privilege in ("SELECT", "INSERT")),
        Grant("SELECT", "destinations"), Grant("SELECT", "contacts"),
        *(Grant(privilege, "evidence_follow_ups") for privilege in ("SELECT", "INSERT", "UPDATE")),
        *(Grant(privilege, table) for table in ("partner_sessions", "partner_session_waits")
          for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    ))
    dispatcher = ("exports_dispatcher", "EXPORTS_DISPATCHER_DATABASE_URL", "dispatcher_database_url", (
        Grant("SELECT", "outbox"), Grant("UPDATE", "outbox", ("published_at",)),
        Grant("SELECT", "export_jobs", ("id", "tenant_id")),
    ))
    return tuple(Role(*role) for role in (app, dispatcher))


def grant_statements() -> list[str]:
    """The GRANTs of `worker_roles`, for `exports migrate` to apply again: the schema's own, so idempotent."""
    statements = []
    for role in worker_roles():
        statements.append(f"GRANT USAGE ON SCHEMA public TO {role.name}")
        for grant in role.grants:
            columns = f" ({', '.join(grant.columns)})" if grant.columns else ""
            statements.append(f"GRANT {grant.privilege}{columns} ON {grant.table} TO {role.name}")
    return statements


_PRIVILEGES = """
SELECT g.tbl, g.col, g.priv,
       CASE WHEN to_regclass(g.tbl) IS NULL THEN false
            WHEN g.col = '' THEN has_table_privilege(g.tbl, g.priv)
            WHEN NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a WHERE a.attrelid = to_regclass(g.tbl)
                             AND a.attname = g.col AND NOT a.attisdropped) THEN false
            ELSE has_column_privilege(g.tbl, g.col, g.priv) END AS granted
FROM unnest($1::text[], $2::text[], $3::text[]) AS g(tbl, col, priv)
"""


async def _privilege_problems(conn: asyncpg.Connection, role: Role) -> list[str]:
    user = await conn.fetchval("SELECT current_user")
    fix = "run `exports migrate` as the owner (it grants them)"
    if user != role.name:
        fix += f", and make {user} a member of {role.name} (GRANT {role.name} TO {user})"
    who = f"database role {user} ({role.setting})"
    if not await conn.fetchval("SELECT has_schema_privilege('public', 'USAGE')"):
        return [f"{who} lacks USAGE on schema public: {fix}"]
    rows = [(grant.table, column, grant.privilege) for grant in role.grants for column in (grant.columns or ("",))]
    checked = await conn.fetch(_PRIVILEGES, *(list(values) for values in zip(*rows, strict=True)))
    missing: dict[tuple[str, str], list[str]] = {}
    for row in checked:
        if not row["granted"]:
            missing.setdefault((row["priv"], row["tbl"]), []).append(row["col"])
    return [f"{who} lacks {privilege} on {table}"
            + (f" (columns {', '.join(columns)})" if any(columns) else "") + f": {fix}"
            for (privilege, table), columns in missing.items()]


_BYPASSES = """
SELECT current_user AS name, r.rolsuper AS superuser, r.rolbypassrls AS bypassrls,
       coalesce((SELECT pg_has_role(current_user, c.relowner, 'MEMBER') FROM pg_catalog.pg_class c
                 WHERE c.oid = to_regclass('export_jobs')), false) AS owner
FROM pg_catalog.pg_roles r WHERE r.rolname = current_user
"""


async def _bypass_problems(conn: asyncpg.Connection, role: Role) -> list[str]:
    """A login that every rule of the database lets through: a superuser or one with BYPASSRLS passes the policies,
    and the tables' owner (or a member of it) is exempt from the transition rules (migration 0005). The grants
    alone would accept it (they ask for at least the role's privileges), and roles.sql checks these attributes only
    for the roles it sets up; a worker so connected would enforce nothing that the database is said to."""
    found = await conn.fetchrow(_BYPASSES)
    if found is None:
        return []
    what = [label for label, has in (("is a superuser", found["superuser"]), ("has BYPASSRLS", found["bypassrls"]),
                                     ("owns the tables (or is a member of their owner)", found["owner"])) if has]
    if not what:
        return []
    return [f"database role {found['name']} ({role.setting}) {' and '.join(what)}: the database's rules would not "
            f"hold for it; connect as {role.name}, or a login that is a member of it and none of these"]


async def _role_problems(conn: asyncpg.Connection, role: Role) -> list[str]:
    """What the role's own connection lacks, or has too much of; one query at a time (one connection)."""
    return [*await _privilege_problems(conn, role), *await _bypass_problems(conn, role)]


async def _revision_problems(conn: asyncpg.Connection, role: Role) -> list[str]:
    head = head_revision()
    try:
        found = await database_revision(conn)
    except asyncpg.InsufficientPrivilegeError:
        return [f"database role {role.name} ({role.setting}) may not read alembic_version, so the schema revision "
                f"is unknown: the database was last migrated by an earlier release; this worker needs {head}: run "
                f"this release's `exports migrate` as the owner (EXPORTS_OWNER_DATABASE_URL; it grants the read)"]
    if found is None:
        return [f"database not migrated (no schema revision in alembic_version); this worker needs {head}: run "
                f"`exports migrate` as the owner (EXPORTS_OWNER_DATABASE_URL)"]
    if found == head:
        return []
    if found in known_revisions():
        return [f"database at revision {found}, this worker needs {head}: run `exports migrate` as the owner "
                f"(EXPORTS_OWNER_DATABASE_URL)"]
    return [newer_revision_line(found)]


async def _connect(settings: Settings, role: Role) -> asyncpg.Connection | str:
    """The role's connection, or the problem line of a URL or login that waiting cannot mend; `Away` when
    PostgreSQL does not answer (refused, silent, starting up, out of connections)."""
    url = getattr(settings, role.field)
    if not url.strip():
        return f"setting {role.setting}: no database URL configured"
    if not url.startswith("postgresql+asyncpg://"):
        return f"setting {role.setting}: not a usable URL: it must start with postgresql+asyncpg://"
    try:
        return await asyncpg.connect(asyncpg_dsn(url), timeout=CONNECT_TIMEOUT_SECONDS)
    except ValueError as exc:  # a malformed sslmode, port, ... (asyncpg's ClientConfigurationError is one too)
        return f"setting {role.setting}: {exc}"
    except Exception as exc:
        server = errors.postgres_error(exc)
        if server is not None and not errors.is_transient(exc):  # a login the server refused: wrong password, ...
            return f"PostgreSQL refused the connection of {role.setting}: {server}"
        raise Away(f"PostgreSQL ({role.setting}) did not answer: {errors.describe(exc)}") from None


@dataclass
class DatabaseCheck:
    problems: list[str]
    # Roles whose connection did not answer, to check once it does (the role can change nothing meanwhile), and why.
    waiting: tuple[Role, ...] = ()
    reasons: tuple[str, ...] = ()


async def check_database(settings: Settings, roles: tuple[Role, ...] | None = None) -> DatabaseCheck:
    """The problem lines of the schema revision (read as the application role) and of each role's privileges, for
    the roles that answer; those that do not are `waiting`. The privileges are checked only at the right revision:
    at another, the revision's line says what to do."""
    roles = worker_roles() if roles is None else roles
    outcomes = await asyncio.gather(*(_connect(settings, role) for role in roles), return_exceptions=True)
    connected = {role: outcome for role, outcome in zip(roles, outcomes, strict=True)
                 if isinstance(outcome, asyncpg.Connection)}
    try:
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Away):
                raise outcome
        settings_problems = [outcome for outcome in outcomes if isinstance(outcome, str)]
        if settings_problems:
            return DatabaseCheck(settings_problems)
        away = [(role, str(outcome)) for role, outcome in zip(roles, outcomes, strict=True)
                if isinstance(outcome, Away)]
        app = roles[0] if roles[0].name == "exports_app" else None
        if app is not None and app not in connected:  # the revision is read as the application: all wait for it
            return DatabaseCheck([], waiting=roles, reasons=tuple(reason for _, reason in away))
        try:
            problems = await _revision_problems(connected[app], app) if app is not None else []
            if not problems:
                found = await asyncio.gather(*(_role_problems(conn, role) for role, conn in connected.items()))
                problems = [line for lines in found for line in lines]
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            if errors.is_transient(exc):
                return DatabaseCheck([], waiting=roles, reasons=(
                    f"PostgreSQL went away during the check: {errors.describe(exc)}",))
            raise
        if problems:
            return DatabaseCheck(problems)
        return DatabaseCheck([], waiting=tuple(role for role, _ in away), reasons=tuple(reason for _, reason in away))
    finally:
        for conn in connected.values():
            await conn.close(timeout=CONNECT_TIMEOUT_SECONDS)


# --- the worker's start -------------------------------------------------------------------------------------------


async def _temporal_until_answered(settings: Settings, client: Client, stopping: asyncio.Event) -> list[str]:
    delay = 1.0
    while not stopping.is_set():
        try:
            return await check_search_attributes(settings, client)
        except Away as exc:
            log.warning("%s; trying again in %.0f s", exc, delay)
        await _pause(stopping, delay)
        delay = min(delay * 2, 30.0)
    return []


async def _pause(stopping: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        pass


async def before_polling(settings: Settings, client: Client, stopping: asyncio.Event) -> DatabaseCheck:
    """Every check, once, with Temporal connected: raises PreflightFailed (its lines logged) on a problem. The
    roles whose database connection did not answer are `waiting` in the answer: `database_later` checks them."""
    if settings.preflight_skip.strip() == "search-attributes":
        log.warning("preflight: the search attributes are not checked (%s=search-attributes)", SKIP_SETTING)

        async def unchecked() -> list[str]:
            return []

        temporal = unchecked()
    else:
        temporal = _temporal_until_answered(settings, client, stopping)
    found, database = await asyncio.gather(temporal, check_database(settings))
    refuse_if_any(found + database.problems)
    for reason in database.reasons:
        log.warning("preflight: %s; the schema and grant checks run once it answers (that role can change "
                    "nothing meanwhile)", reason)
    return database


async def database_later(settings: Settings, waiting: tuple[Role, ...], stopping: asyncio.Event) -> list[str]:
    """The database checks of the roles that did not answer at start, once they do, trying again every few
    seconds up to 30; their problem lines (logged), [] once they pass or when asked to stop first."""
    delay = 1.0
    while waiting and not stopping.is_set():
        await _pause(stopping, delay)
        if stopping.is_set():
            break
        checked = await check_database(settings, waiting)
        if checked.problems:
            _log_refusal(checked.problems, "the worker stops taking tasks")
            return checked.problems
        if checked.waiting:
            delay = min(delay * 2, 30.0)
        else:
            log.info("preflight: the database checks passed (%s)", ", ".join(role.setting for role in waiting))
        waiting = checked.waiting
    return []


def refuse_if_any(problems: Iterable[str]) -> None:
    problems = list(problems)
    if problems:
        _log_refusal(problems, "the worker took no task")
        raise PreflightFailed(problems)


def _log_refusal(problems: list[str], what: str) -> None:
    for line in problems:
        log.error("preflight: %s", line)
    log.error("preflight: %d problem(s) above; %s and exits with status 2", len(problems), what)

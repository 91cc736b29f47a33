"""Where a database URL says to connect, read as libpq reads it: one host or several (a primary and its standbys),
in each of the forms that libpq, asyncpg and SQLAlchemy document:

    postgresql+asyncpg://user@host1:port1,host2:port2/database        libpq's URI: hosts before the path
    postgresql+asyncpg://user@/database?host=host1,host2&port=p1,p2   libpq's keywords: a host list, a port list
    postgresql+asyncpg://user@/database?host=host1:p1&host=host2:p2   SQLAlchemy's asyncpg form: host repeated
    postgresql+asyncpg://user@/database?host=host1:p1,host2:p2        asyncpg's reading of a host list

store/db.py hands asyncpg (which connects) and SQLAlchemy (which only needs to parse the URL) each a spelling
they read the same way. A URL that cannot be read without dropping a host, a port or a parameter is refused
here, before anything connects, with MalformedDatabaseUrl: the settings (store/settings.py) refuse it at start,
one line naming the setting and the form that works, exit status 2. Imports nothing heavy: the settings use it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

# libpq's values, which asyncpg reads as well.
TARGET_SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
WORKING_FORM = ("postgresql+asyncpg://user@host1:port1,host2:port2/database?target_session_attrs=read-write "
                "(or ?host=host1,host2&port=port1,port2&target_session_attrs=read-write)")
# Left as written in a query asyncpg or SQLAlchemy reads: socket paths, host:port, lists, IPv6 brackets.
QUERY_SAFE = "/:,[]"
# Parameters whose repetition store/db.py's asyncpg_dsn answers itself (sslmode and ssl are one setting), and the
# two lists that may be given more than once (SQLAlchemy's host=h1:p1&host=h2:p2).
_REPEATABLE = ("host", "port", "ssl", "sslmode")


class MalformedDatabaseUrl(ValueError):
    """A URL whose hosts, ports or target_session_attrs cannot be read whole: what is wrong, then the form that
    works. Never quotes the user or password."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}; write a primary and its standby as {WORKING_FORM}")
        self.problem = problem


@dataclass(frozen=True)
class Host:
    address: str  # a name, an IPv4 address, an IPv6 address in brackets, or a Unix socket's directory
    port: int | None  # the port written with it (host:port), if any

    @property
    def spec(self) -> str:
        return self.address if self.port is None else f"{self.address}:{self.port}"


@dataclass(frozen=True)
class DatabaseUrl:
    scheme: str
    auth: str | None  # user[:password] as written (percent-encoded); None when the URL has no '@'
    path: str  # "/database", or ""
    hosts: tuple[Host, ...]  # from before the path or from ?host=, never both
    ports: tuple[int, ...]  # from ?port=: one for every host, or one per host; never with a host's own port
    query: tuple[tuple[str, str], ...]  # every query parameter as written, host and port included, in order
    # Whether asyncpg would read the hosts as written otherwise than libpq does: it keeps only the last of a
    # repeated host= or port=, ignores ?port= when the hosts come before the path, and cannot read an IPv6
    # address without brackets in ?host=. Then store/db.py writes the hosts out again (`host_params`).
    respell: bool

    def host_params(self) -> list[tuple[str, str]]:
        """The hosts as one host= list (host:port where a host has its own port) and ?port= as given."""
        params = [("host", ",".join(host.spec for host in self.hosts))] if self.hosts else []
        if self.ports:
            params.append(("port", ",".join(str(port) for port in self.ports)))
        return params

    def other_params(self) -> list[tuple[str, str]]:
        return [(key, value) for key, value in self.query if key not in ("host", "port")]

    def one_host_each(self) -> list[tuple[Host, str]]:
        """Each host with the URL naming it alone (`each_host`)."""
        out = []
        for number, host in enumerate(self.hosts):
            params = [("host", host.address)]
            port = host.port if host.port is not None else (
                self.ports[number] if len(self.ports) > 1 else self.ports[0] if self.ports else None)
            if port is not None:
                params.append(("port", str(port)))
            out.append((host, f"{self.base()}?{urlencode([*params, *self.other_params()], safe=QUERY_SAFE)}"))
        return out

    def base(self, netloc_hosts: str = "") -> str:
        """scheme://[auth@]hosts/path, the hosts as given (default: none)."""
        auth = "" if self.auth is None else f"{self.auth}@"
        return f"{self.scheme}://{auth}{netloc_hosts}{self.path}"


def parse(url: str) -> DatabaseUrl:
    """The URL's hosts, ports and parameters; MalformedDatabaseUrl when they cannot be read whole."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an IPv6 bracket left open
        raise MalformedDatabaseUrl(f"the URL does not parse ({exc})") from None
    auth, at, hostlist = parts.netloc.partition("@")  # the first '@', as libpq and asyncpg split it
    if not at:
        auth, hostlist = "", parts.netloc
    query = tuple(parse_qsl(parts.query, keep_blank_values=True))

    seen: set[str] = set()
    host_values: list[str] = []
    port_values: list[str] = []
    for key, value in query:
        if key == "host":
            host_values.append(value)
        elif key == "port":
            port_values.append(value)
        elif key == "target_session_attrs" and value not in TARGET_SESSION_ATTRS:
            raise MalformedDatabaseUrl(f"target_session_attrs={value!r} is not one of "
                                       f"{', '.join(TARGET_SESSION_ATTRS)}")
        if key in seen and key not in _REPEATABLE:
            raise MalformedDatabaseUrl(f"{key} is given more than once, and only one would count")
        seen.add(key)

    authority_hosts = [_host(spec, in_query=False) for spec in hostlist.split(",")] if hostlist else []
    query_hosts = [_host(spec, in_query=True) for value in host_values for spec in value.split(",")]
    if authority_hosts and query_hosts:
        raise MalformedDatabaseUrl("hosts are named both before the path and in ?host=, and only one of them "
                                   "would count")
    hosts = authority_hosts or query_hosts
    ports = tuple(_port(port, f"?port={value}") for value in port_values for port in value.split(","))
    if ports and any(host.port is not None for host in hosts):
        raise MalformedDatabaseUrl("ports are given both with the hosts (host:port) and in ?port=")
    if len(ports) > 1 and hosts and len(ports) != len(hosts):
        raise MalformedDatabaseUrl(f"{len(ports)} ports in ?port= for {len(hosts)} hosts: give one port for "
                                   f"every host, or one per host")
    respell = (len(host_values) > 1 or len(port_values) > 1 or bool(authority_hosts and ports)
               or any(spec.count(":") > 1 and not spec.startswith(("[", "/"))
                      for value in host_values for spec in value.split(",")))
    return DatabaseUrl(scheme=parts.scheme, auth=auth if at else None, path=parts.path, hosts=tuple(hosts),
                       ports=ports, query=query, respell=respell)


def each_host(url: str) -> list[str]:
    """The URL once per host it names, in order, each naming that host alone (as ?host=, with its port), every other
    parameter kept: for a connect that gives each host its own timeout, as libpq's connect_timeout does. A URL
    with one host or none, as it is."""
    parsed = parse(url)
    return [one for _, one in parsed.one_host_each()] if len(parsed.hosts) > 1 else [url]


def sqlalchemy_url(url: str) -> str:
    """The URL as SQLAlchemy's asyncpg dialect parses it without error: as written with one host, else with the
    hosts as ?host=h1,h2&port=p1,p2 (every port given: the dialect requires it). SQLAlchemy only parses it, for
    the engine's address in messages: the connection takes asyncpg's DSN (store/db.py, make_engine)."""
    parsed = parse(url)
    if len(parsed.hosts) <= 1 and not parsed.respell:
        return url
    if len(parsed.ports) > 1:
        ports = list(parsed.ports)
    else:  # as asyncpg will: ?port=, else the host's own, else PGPORT, else 5432
        default = parsed.ports[0] if parsed.ports else _default_port()
        ports = [default if host.port is None else host.port for host in parsed.hosts]
    params = [("host", ",".join(host.address for host in parsed.hosts)),
              ("port", ",".join(str(port) for port in ports)), *parsed.other_params()]
    return f"{parsed.base()}?{urlencode(params, safe=QUERY_SAFE)}"


def check(url: str) -> str:
    """The URL, when its hosts, ports and target_session_attrs can be read whole; else MalformedDatabaseUrl."""
    parse(url)
    return url


def _host(spec: str, *, in_query: bool) -> Host:
    """One host of a list: name, name:port, [IPv6], [IPv6]:port, or a Unix socket's directory (percent-encoded
    before the path, where libpq and asyncpg decode it; as written in ?host=)."""
    if not spec:
        raise MalformedDatabaseUrl("an empty host in the list of hosts")
    if spec.startswith("/"):
        return Host(spec, None)
    if spec.startswith("["):
        address, bracket, rest = spec.partition("]")
        if not bracket or address == "[" or (rest and not rest.startswith(":")):
            raise MalformedDatabaseUrl(f"host {spec!r} is not an IPv6 address in brackets ([::1] or [::1]:5432)")
        return Host(address + "]", _port(rest[1:], spec) if rest else None)
    if spec.count(":") > 1:
        if in_query:  # libpq's host= keyword takes an IPv6 address as it is: asyncpg reads it in brackets
            return Host(f"[{spec}]", None)
        raise MalformedDatabaseUrl(f"host {spec!r}: an IPv6 address before the path is written in brackets "
                                   f"([::1]:5432)")
    address, colon, port = spec.partition(":")
    if not in_query:
        address = unquote(address)
    if not address:
        raise MalformedDatabaseUrl(f"host {spec!r} has no name")
    return Host(address, _port(unquote(port) if not in_query else port, spec) if colon else None)


def _port(text: str, where: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise MalformedDatabaseUrl(f"port {text!r} in {where!r} is not a number from 1 to 65535")
    return int(text)


def _default_port() -> int:
    """PGPORT when it is one port, else libpq's 5432 (only for SQLAlchemy's reading; asyncpg applies its own)."""
    value = os.environ.get("PGPORT", "").strip()
    return int(value) if value.isascii() and value.isdigit() and 1 <= int(value) <= 65535 else 5432

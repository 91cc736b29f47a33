"""Connecting to Temporal the way every part of this project does: with the pydantic data converter, to the
cluster that the settings name.

Where the connection goes (docs/operating.md, "Connecting to Temporal"): an explicitly set
EXPORTS_TEMPORAL_ADDRESS or EXPORTS_TEMPORAL_NAMESPACE wins; otherwise the SDK's environment configuration
(`temporalio.envconfig`: the TOML profile chosen by TEMPORAL_PROFILE in TEMPORAL_CONFIG_FILE or the default file,
overridden by TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, ...); otherwise 127.0.0.1:7233 and the `default` namespace.
An API key, TLS and gRPC metadata come from the environment configuration only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NoReturn

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfigProfile, ClientConnectConfig
from temporalio.service import RPCError

from store.settings import Settings

# How long a command waits for PostgreSQL or Temporal to answer a connection before it says it cannot reach it.
CONNECT_TIMEOUT_SECONDS = 5.0

DEFAULT_ADDRESS = "127.0.0.1:7233"
DEFAULT_NAMESPACE = "default"
# When neither this project's nor the SDK's settings name an address: what the messages point the operator at.
UNSET_ADDRESS = "EXPORTS_TEMPORAL_ADDRESS or TEMPORAL_ADDRESS, neither set"

_TLS_PATHS = ("TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_KEY_PATH", "TEMPORAL_TLS_SERVER_CA_CERT_PATH")
_TLS_SWITCH = {"1": True, "true": True, "0": False, "false": False}


class Unreachable(Exception):
    """PostgreSQL or Temporal could not be reached: not configured, a malformed address, refused, or silent for
    CONNECT_TIMEOUT_SECONDS. Raised before anything was sent to it."""

    def __init__(self, component: str, setting: str, where: str, reason: str) -> None:
        self.component, self.setting, self.where, self.reason = component, setting, where, reason
        at = f" at {where}" if where else ""
        super().__init__(f"{component}{at} ({setting}): {reason}")


class NotConfigured(Unreachable):
    """The settings cannot name a usable connection (a malformed address, an unknown profile, an unreadable config
    or certificate file): found before any connection attempt, so trying again cannot help."""


@dataclass(frozen=True)
class TemporalTarget:
    """What `Client.connect` gets, and which setting supplied each part (named in every error message)."""

    config: ClientConnectConfig
    address_setting: str
    namespace_setting: str
    # Which settings turned TLS on (empty when it is off): named when the handshake fails.
    tls_settings: tuple[str, ...] = field(default=())

    @property
    def address(self) -> str:
        return self.config["target_host"]

    @property
    def namespace(self) -> str:
        return self.config["namespace"]

    @property
    def setting(self) -> str:
        return self.address_setting + (f"; TLS from {', '.join(self.tls_settings)}" if self.tls_settings else "")


def default_config_file(environ: Mapping[str, str]) -> str:
    """Where the SDK looks for its TOML file when TEMPORAL_CONFIG_FILE is not set (for messages only)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    elif sys.platform == "win32":
        base = Path(environ.get("APPDATA") or Path.home())
    else:
        base = Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return str(base / "temporalio" / "temporal.toml")


def temporal_target(settings: Settings, environ: Mapping[str, str] | None = None) -> TemporalTarget:
    """The connection the settings describe, by the precedence above; `NotConfigured` when they describe none.
    Reads files (the profile, certificates) but connects to nothing."""
    env = dict(os.environ if environ is None else environ)
    config_file = env.get("TEMPORAL_CONFIG_FILE", "")
    profile_name = env.get("TEMPORAL_PROFILE", "") or None
    file_label = f"TEMPORAL_CONFIG_FILE={config_file}" if config_file else default_config_file(env)
    profile_label = f"profile {profile_name or 'default'} in {file_label}"

    def refuse(setting: str, reason: str) -> NotConfigured:
        return NotConfigured("Temporal", setting, "", reason)

    # The SDK reads a missing TEMPORAL_CONFIG_FILE as an empty one: a typo would silently connect elsewhere.
    if config_file and not Path(config_file).is_file():
        raise refuse("TEMPORAL_CONFIG_FILE", f"no such file: {config_file}")
    tls_switch = env.get("TEMPORAL_TLS", "")
    # The SDK takes any other value (e.g. "yes") as "not configured", which turns TLS on: say so instead.
    if tls_switch and tls_switch.strip().lower() not in _TLS_SWITCH:
        raise refuse("TEMPORAL_TLS", f"{tls_switch!r} is not one of true, false, 1, 0")
    try:
        profile = ClientConfigProfile.load(profile_name, override_env_vars=env)
    except Exception as exc:  # the bridge's ConfigError: an unknown profile, a TOML syntax error, ...
        gist = str(exc).strip().splitlines()
        setting = "TEMPORAL_PROFILE" if profile_name and "not found" in str(exc) else (
            "TEMPORAL_CONFIG_FILE" if config_file else file_label)
        reason = f"{gist[0] if gist else type(exc).__name__}"
        if len(gist) > 1 and "parse error" in gist[0].lower():  # the TOML parser's own position line
            reason = " ".join(line.strip(" |^") for line in gist if line.strip(" |^")).strip()
        if setting == "TEMPORAL_PROFILE":
            reason = f"profile {profile_name!r} not found in {file_label}"
        raise refuse(setting, reason) from None
    try:
        config = profile.to_client_connect_config()  # reads the certificate files
    except OSError as exc:
        named = [name for name in _TLS_PATHS if env.get(name) and env[name] == exc.filename]
        setting = named[0] if named else f"TLS of {profile_label}"
        raise refuse(setting, f"cannot read {exc.filename}: {exc.strerror}") from None

    def pick(field: str, variable: str, config_key: Literal["target_host", "namespace"], default: str,
             unset: str) -> tuple[str, str]:
        """One part of the connection, by the precedence above, and the setting that supplied it."""
        if field in settings.model_fields_set:
            return getattr(settings, field), f"EXPORTS_{field.upper()}"
        if env.get(variable):
            return env[variable], variable
        if config.get(config_key):
            return config[config_key], profile_label
        return default, unset

    address, address_setting = pick("temporal_address", "TEMPORAL_ADDRESS", "target_host", DEFAULT_ADDRESS,
                                    UNSET_ADDRESS)
    namespace, namespace_setting = pick("temporal_namespace", "TEMPORAL_NAMESPACE", "namespace", DEFAULT_NAMESPACE,
                                        "EXPORTS_TEMPORAL_NAMESPACE or TEMPORAL_NAMESPACE")

    if not address.strip():
        raise refuse(address_setting, "no address configured")
    if "://" in address:  # the SDK still takes a URL, with a warning on stderr, and will refuse it later
        raise refuse(address_setting, f"{address!r} is not host:port (no scheme)")
    if not namespace.strip():
        raise refuse(namespace_setting, "no namespace configured")
    config["target_host"], config["namespace"] = address, namespace
    return TemporalTarget(config=config, address_setting=address_setting, namespace_setting=namespace_setting,
                          tls_settings=_tls_settings(config, env, profile, profile_label))


def _tls_settings(config: ClientConnectConfig, env: Mapping[str, str], profile: ClientConfigProfile,
                  profile_label: str) -> tuple[str, ...]:
    if not config.get("tls"):
        return ()
    named = tuple(name for name in sorted(env) if name.startswith("TEMPORAL_TLS") or name == "TEMPORAL_API_KEY")
    return named or (profile_label,)


async def connect_temporal(settings: Settings, *, timeout: float | None = None,
                           environ: Mapping[str, str] | None = None) -> Client:
    """The client. With a timeout (the command line, the worker's start), a connection that fails or is not
    answered within it is `Unreachable`; without one, the SDK's own errors and retries stand. Settings that
    describe no usable connection are `NotConfigured` either way, before any attempt."""
    target = temporal_target(settings, environ)
    try:
        return await asyncio.wait_for(Client.connect(**target.config, data_converter=pydantic_data_converter),
                                      timeout)
    except TimeoutError:
        raise Unreachable("Temporal", target.setting, target.address, f"no answer within {timeout:g} s") from None
    except ValueError as exc:  # a malformed address, found when the SDK parses it
        raise NotConfigured("Temporal", target.address_setting, target.address, short_reason(exc)) from None
    except (RuntimeError, RPCError) as exc:  # the SDK's connection errors
        if timeout is None:
            raise
        raise Unreachable("Temporal", target.setting, target.address, _reason(exc, target)) from None


def _reason(exc: BaseException, target: TemporalTarget) -> str:
    text = str(exc)
    if target.tls_settings and "InvalidContentType" in text:  # the server answered in plain text
        return "TLS handshake failed: the server does not answer in TLS"
    if target.tls_settings and any(word in text.lower() for word in ("tls", "certificate", "handshake")):
        return f"TLS handshake failed ({short_reason(exc)})"
    return short_reason(exc)


def short_reason(exc: BaseException) -> str:
    """The gist of a connection error: the innermost message of the SDK's nested transport error, if any."""
    text = str(exc) or type(exc).__name__
    messages = re.findall(r'message: "([^"]*)"', text)
    return messages[-1].lower() if messages else text.splitlines()[0]


def exit_now(code: int) -> NoReturn:
    """End the process with `code`, skipping the interpreter's teardown: the Temporal SDK's runtime threads can
    call into Python while it finalizes, which aborts the process (SIGABRT, status 134) now and then
    (temporalio/sdk-python#300), and dropping a runtime whose connection attempt is still pending can hold up the
    exit for minutes. What the process wrote is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`exports list | head`): nothing more to say there
            pass
    os._exit(code)

"""Case PT1 for the partner: the SFTP session goes through tests/helpers/tcp_cut.py's proxy, which goes silent
(nothing forwarded either way, no socket closed, as a network that drops packets). Only the SSH keepalives can end
a request that has no bound of its own: the session is given up on within the connect timeout."""

from __future__ import annotations

import asyncio
import time

import asyncssh
import pytest

from activities.partner_connection import connect
from starter.localstack.partner import LocalPartner
from tests.helpers.tcp_cut import TcpCutProxy

CONNECT = 2.0  # seconds: the session's connect timeout, which paces its keepalives
LATE = 1.0  # how late the keepalives may give up on a loaded machine
BOUND = 20.0  # the test's own bound


@pytest.mark.spec("PT1")
async def test_a_partner_gone_silent_ends_the_session_within_the_connect_timeout(partner: LocalPartner):
    dest = partner.destination()
    async with TcpCutProxy(dest.host, dest.port) as proxy:
        async with connect(dest.model_copy(update={"port": proxy.port}), connect_timeout=CONNECT) as sftp:
            assert await asyncio.wait_for(sftp.isdir(dest.final_dir), BOUND)
            proxy.go_silent()
            started = time.monotonic()
            with pytest.raises((asyncssh.Error, OSError)) as raised:
                await asyncio.wait_for(sftp.isdir(dest.final_dir), BOUND)
            took = time.monotonic() - started
            print(f"PT1: a silent partner ended the session after {took:.2f} s: {raised.value!r}")
            assert not isinstance(raised.value, TimeoutError), "no keepalive ended the session"
            assert took < CONNECT + LATE

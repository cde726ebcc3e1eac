"""Shared fixtures: real servers (redis-server, mooncake_master) started on 127.0.0.1 for the session."""

import pytest

from tests.servers import MooncakeMaster, RedisServer, running


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server on a free port with no persistence; ``.url``, ``.port``, ``.pid``, ``.restart()``."""
    with running(RedisServer.start) as server:
        yield server


@pytest.fixture(scope="session")
def mooncake_master():
    """A mooncake_master on free ports with its HTTP metadata server; ``.url``, ``.client_config()``."""
    with running(MooncakeMaster.start) as server:
        yield server

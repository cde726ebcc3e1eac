"""Shared fixtures: real servers (redis-server, mooncake_master) started on 127.0.0.1 for the session."""

import pytest

from tests.servers import MooncakeMaster, RedisServer, ServerUnavailable


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server on a free port with no persistence; ``.url``, ``.port``, ``.pid``, ``.restart()``."""
    try:
        server = RedisServer.start()
    except ServerUnavailable as why:
        pytest.skip(str(why))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_master():
    """A mooncake_master on free ports with its HTTP metadata server; ``.url``, ``.client_config()``."""
    try:
        server = MooncakeMaster.start()
    except ServerUnavailable as why:
        pytest.skip(str(why))
    yield server
    server.stop()

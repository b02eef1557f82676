"""Fixtures of the cluster tests; the servers themselves are in ``tests/cluster_servers.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster_servers import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free loopback port, killed after it."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()

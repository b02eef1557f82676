"""The real servers the cluster tests run against: a redis-server (:class:`RedisServer`)
and a one-member etcd (:class:`EtcdServer`, :func:`etcd_server`), each a process of its
own on free loopback ports; the marks that skip a test module without them
(:data:`needs_redis`, :data:`needs_etcd`: never in CI, where ``.ci/run`` installs both);
and :func:`eventually`, which waits for what the gateways converge to.

``tests/cluster/conftest.py`` holds the ``redis_server`` fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qrtest import free_port

__all__ = [
    "ETCD",
    "ETCDCTL",
    "REDIS_SERVER",
    "EtcdServer",
    "RedisServer",
    "etcd_server",
    "eventually",
    "needs_etcd",
    "needs_redis",
]

IN_CI = os.environ.get("QUANTROUTE_CI") == "1"  # .ci/run installs them: never skip there
REDIS_SERVER = shutil.which("redis-server")
ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")

needs_redis = pytest.mark.skipif(REDIS_SERVER is None and not IN_CI, reason="needs redis-server")
needs_etcd = pytest.mark.skipif(
    (ETCD is None or ETCDCTL is None) and not IN_CI, reason="etcd and etcdctl are not installed"
)


class RedisServer:
    """A redis-server of its own on a loopback port (a free one unless given), nothing
    saved: ``start`` (again after ``kill``, on the same port, empty), ``kill``."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_s: float = 20) -> None:
        """Start it and wait until it answers ``PING``."""
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no"]  # fmt: skip
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL, as a host dies."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


class EtcdServer:
    """A one-member etcd on free loopback ports, its data in ``root``: ``start`` (again
    after ``kill``, on the same ports and data), ``kill`` (SIGKILL: as a host dies)."""

    def __init__(self, root: Path):
        self.data = root / "etcd-data"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.peer = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_s: float = 60) -> None:
        assert ETCD is not None
        argv = [ETCD, "--name", "default", "--data-dir", str(self.data),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
                "--initial-cluster", f"default={self.peer}",
                "--logger", "zap", "--log-level", "error"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "etcd exited while starting"
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, timeout=1)
                if r.status_code == 200:
                    return
            time.sleep(0.1)
        pytest.fail(f"etcd did not answer in {ready_s:g} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def ctl(self, *args: str) -> str:
        """``etcdctl`` against this server, as an operator runs it."""
        assert ETCDCTL is not None
        done = subprocess.run(
            [ETCDCTL, "--endpoints", self.url, *args],
            env={**os.environ, "ETCDCTL_API": "3"},
            capture_output=True,
            check=True,
            timeout=60,
        )
        return done.stdout.decode()


@contextlib.contextmanager
def etcd_server(root: Path) -> Iterator[EtcdServer]:
    """An :class:`EtcdServer` started in ``root``, killed on the way out."""
    server = EtcdServer(root)
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def eventually(check: Any, within_s: float = 1.0, step_s: float = 0.01) -> float:
    """Poll ``check`` (sync or async) until it is true; how long it took (fails past
    ``within_s``)."""
    started = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            pytest.fail(f"not true within {within_s:g} s")
        await asyncio.sleep(step_s)

"""Servers the benchmarks start: a subprocess on a free loopback port, in a session of
its own (so stopping it stops its workers too), logging to a file, always stopped."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

log = logging.getLogger("bench")


def quantroute_command() -> str:
    """The ``quantroute`` executable beside this interpreter, else the one on PATH."""
    exe = Path(sys.executable).with_name("quantroute")
    return str(exe) if exe.exists() else shutil.which("quantroute") or "quantroute"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(slots=True)
class Server:
    """A server subprocess in a session of its own, so stopping it stops its workers too."""

    name: str
    argv: list[str]
    port: int
    ready_path: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        log.info("started %s (pid %d, port %d)", self.name, self.proc.pid, self.port)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.base_url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode})" + self.tail())
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.ready_path).status_code == 200:
                        return
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s" + self.tail())

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the server's process tree so far."""
        return tree_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def own_cpu_s(self) -> float:
        """CPU seconds of the server's own process, without its children (its workers)."""
        if self.proc is None:
            return 0.0
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(self.proc.pid).cpu_times()
            return float(times.user + times.system)
        return 0.0

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            return f"; the end of {self.log_path}:\n" + "\n".join(text)
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # the server shuts down its own workers
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):  # whatever is left of its session
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5.0)
        log.info("stopped %s", self.name)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total

"""Real ``llama-server`` processes for tests: the binary ``scripts/llama_server_build.sh``
builds (the Makefile's ``llama-server`` target, which ``make test`` runs first) and one
server on a loopback port that a test may kill and start again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from qrtest import free_port

ROOT = Path(__file__).resolve().parents[1]


def llama_server_binary() -> Path:
    """The llama-server ``scripts/llama_server_build.sh`` built (found by its cache key);
    skips the test when it is not built."""
    key = subprocess.run(
        ["bash", str(ROOT / "scripts" / "llama_server_build.sh"), "--key"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    home = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    cache = Path(os.environ.get("QUANTROUTE_CACHE", f"{home}/quantroute"))
    binary = cache / "llama-server" / key / "llama-server"
    if not binary.is_file():
        pytest.skip(
            f"llama-server is not built ({binary}); build it with "
            "`bash scripts/llama_server_build.sh .venv/bin/python` (~10 min on 2 cores)"
        )
    return binary


SERVING = ("-t", "1", "-np", "4", "--metrics", "-c", "1024")  # four slots, 1 thread


@dataclass
class LlamaServer:
    """One llama-server serving ``gguf`` on a fixed loopback port (``args``: its flags
    beyond model, host and port), which a test may kill and start again."""

    gguf: Path
    log: Path
    args: Sequence[str] = SERVING
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Its OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        argv = [str(llama_server_binary()), "-m", str(self.gguf), "--port", str(self.port),
                "--host", "127.0.0.1", "--no-webui", *self.args]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            time.sleep(0.1)
        pytest.fail("llama-server did not become ready in 60 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def llama_servers(servers: dict[str, LlamaServer]) -> Iterator[dict[str, LlamaServer]]:
    """``servers`` started (all stopped on the way out, whatever happens)."""
    try:
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()

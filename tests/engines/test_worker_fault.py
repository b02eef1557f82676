"""The worker's ``--fault`` hook, on the real worker and the demo model: it fails the way
a real fault does, and only when asked."""

from __future__ import annotations

import signal
import subprocess
import sys

from qrtest import demo_model_dir
from quantroute.engines.base import SamplingParams
from quantroute.engines.llamacpp import wire

GEN = wire.Generate("r1", "def ", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def _worker(*fault: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker"]
    argv += ["--model", str(demo_model_dir() / "f16.gguf"), "--n-threads", "1", "--parallel", "1"]
    return subprocess.Popen(
        [*argv, *fault], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )


def _generate(proc: subprocess.Popen[bytes]) -> list[wire.Event]:
    """Wait for ready, send one generation, and read events until it finishes or the
    worker dies; then close stdin (the worker's signal to shut down)."""
    assert proc.stdin is not None and proc.stdout is not None
    assert isinstance(wire.decode_event(proc.stdout.readline()), wire.Ready)
    proc.stdin.write(wire.encode(GEN))
    proc.stdin.flush()
    events = []
    while line := proc.stdout.readline():
        events.append(wire.decode_event(line))
        if isinstance(events[-1], wire.Finished):
            break
    proc.stdin.close()
    proc.stdout.close()
    return events


def test_sigill_at_first_decode_dies_of_sigill_and_only_when_asked() -> None:
    faulty = _worker("--fault", "sigill-at-first-decode")
    events = _generate(faulty)
    assert faulty.wait(60) == -signal.SIGILL
    assert events == []  # it died before flushing even "start"

    healthy = _worker()
    events = _generate(healthy)
    assert healthy.wait(60) == 0
    kinds = [type(e) for e in events]
    assert kinds == [wire.Started, *[wire.Tokens] * 4, wire.Finished]


def test_exit_at_load_exits_3_before_ready() -> None:
    proc = _worker("--fault", "exit-at-load")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out == b""

"""The worker's ``--fault`` hook, on the real worker and the demo model: it fails the way
a real fault does, and only when asked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from qrtest import demo_model_dir

GEN = {
    "op": "gen",
    "id": "r1",
    "prompt": "def ",
    "s": {
        "max_tokens": 4,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": False,
        "top_logprobs": 0,
        "stop": [],
        "ignore_eos": True,
    },
}


def _worker(*fault: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker"]
    argv += ["--model", str(demo_model_dir() / "f16.gguf"), "--n-threads", "1", "--parallel", "1"]
    return subprocess.Popen(
        [*argv, *fault], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )


def _generate(proc: subprocess.Popen[bytes]) -> list[dict[str, object]]:
    """Wait for ready, send one generation, and read events until it finishes or the
    worker dies; then close stdin (the worker's signal to shut down)."""
    assert proc.stdin is not None and proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    assert ready["ev"] == "ready"
    proc.stdin.write(json.dumps(GEN).encode() + b"\n")
    proc.stdin.flush()
    events = []
    while line := proc.stdout.readline():
        events.append(json.loads(line))
        if events[-1]["ev"] == "fin":
            break
    proc.stdin.close()
    proc.stdout.close()
    return events


def test_sigill_at_first_decode_dies_of_sigill_and_only_when_asked() -> None:
    faulty = _worker("--fault", "sigill-at-first-decode")
    events = _generate(faulty)
    assert faulty.wait(60) == -signal.SIGILL
    assert [e["ev"] for e in events] == []  # it died before flushing even "start"

    healthy = _worker()
    events = _generate(healthy)
    assert healthy.wait(60) == 0
    assert [e["ev"] for e in events] == ["start", "toks", "toks", "toks", "toks", "fin"]


def test_exit_at_load_exits_3_before_ready() -> None:
    proc = _worker("--fault", "exit-at-load")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out == b""

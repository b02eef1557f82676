"""quantroute serve as a real process on a loopback port, driven by the official
``openai`` client and by raw HTTP."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from qrtest import demo_model_dir
from quantroute.registry.manifest import load_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serving(*flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``quantroute serve`` on the demo repository and a free port, until it is ready;
    stopped with SIGTERM after, workers and all."""
    port = _free_port()
    argv = [sys.executable, "-m", "quantroute.cli", "serve", "--repo",
            str(demo_model_dir().parent), "--port", str(port), *flags]  # fmt: skip
    proc = subprocess.Popen(argv)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the server exited while starting"
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the server did not become ready in 90 s")
    yield base, proc
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) == len(load_manifest(demo_model_dir()).branches)  # one each
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "workers outlived the server"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with _serving("--engine-parallel", "4", "--engine-restart-backoff-s", "0.2") as pair:
        yield pair


@pytest.fixture(scope="module")
def long_server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Two sequences of 4096 tokens each: a cancelled generation would otherwise hold
    its sequence for seconds (beyond the demo's training context the text is noise)."""
    with _serving("--engine-parallel", "2", "--engine-n-ctx", "4096") as pair:
        yield pair


@pytest.fixture
def client(server: tuple[str, subprocess.Popen[bytes]]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "tiny-llama"
    assert {"tiny-llama:f16", "tiny-llama:q8_0", "tiny-llama:q4_k_m"} <= set(ids)


def test_chat_non_stream_and_branch_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Write a function."}],
        max_tokens=24,
        temperature=0,
    )
    # which branch depends on the host's free memory (the cpu device): any, but named
    branch = raw.headers["x-quantroute-branch"]
    assert branch in {"tiny-llama:f16", "tiny-llama:q8_0", "tiny-llama:q4_k_m"}
    assert raw.headers["x-quantroute-route-reason"]
    completion = raw.parse()
    assert completion.model == branch
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 24


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-llama:q4_k_m",
        messages=[{"role": "user", "content": "import"}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    with stream:
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert all(c.model == "tiny-llama:q4_k_m" for c in chunks)


def test_completions_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny-llama:q8_0",
        "prompt": "def main():\n",
        "max_tokens": 40,
        "temperature": 0.0,
    }
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert whole.choices[0].text == streamed and streamed


def test_errors_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-llama:q5_k_m", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="x" * 300, max_tokens=300)
    assert info.value.code == "context_length_exceeded"
    assert "512" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="x", temperature=9)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    ok = client.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_errors_over_raw_http(server: tuple[str, subprocess.Popen[bytes]]) -> None:
    base = server[0]
    r = httpx.post(
        f"{base}/v1/chat/completions",
        content=b'{"model": "tiny-llama", "mess',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{base}/v1/completions", json={"model": "tiny-llama", "prompt": "a" * (2 << 20)}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny-llama", "prompt": "x", "n": "2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}


def _worker_pid(server_proc: subprocess.Popen[bytes], branch: str) -> int:
    # a worker is handed its verified file as an open descriptor (--model /proc/self/fd/N)
    for child in psutil.Process(server_proc.pid).children(recursive=True):
        if any(f.path.endswith(f"{branch}.gguf") for f in child.open_files()):
            return int(child.pid)
    raise AssertionError(f"no worker for {branch}")


def test_worker_killed_mid_stream(
    server: tuple[str, subprocess.Popen[bytes]], client: openai.OpenAI
) -> None:
    base, proc = server
    pid = _worker_pid(proc, "q8_0")
    stream = client.completions.create(
        model="tiny-llama:q8_0",
        prompt="class ",
        max_tokens=450,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    with stream, pytest.raises(openai.APIError) as info:
        for _ in stream:
            received += 1
            if received == 3:
                os.kill(pid, signal.SIGKILL)
    assert "q8_0" in info.value.message
    assert httpx.get(f"{base}/healthz").status_code == 200
    # Unpinned requests are served meanwhile; the pinned branch comes back after its restart.
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=2).choices
    deadline = time.monotonic() + 30
    while True:
        try:
            again = client.completions.create(model="tiny-llama:q8_0", prompt="x", max_tokens=2)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert again.choices[0].finish_reason in ("stop", "length")
    assert _worker_pid(proc, "q8_0") != pid


LONG = {"model": "tiny-llama:q8_0", "prompt": "x", "max_tokens": 4000, "ignore_eos": True}


def _first_token_s(base: str) -> float:
    t0 = time.perf_counter()
    body = LONG | {"max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    return time.perf_counter() - t0


def test_a_stream_client_that_hangs_up_frees_its_sequence(
    long_server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """Two clients fill q8_0's two sequences with 4000-token streams and hang up after
    one chunk. Had their generations gone on (seconds), a third would wait for a slot."""
    base = long_server[0]
    with httpx.Client(base_url=base, timeout=30) as http:
        streams = [http.stream("POST", "/v1/completions", json=LONG | {"stream": True})
                   for _ in range(2)]  # fmt: skip
        for r in (s.__enter__() for s in streams):
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        for s in streams:
            s.__exit__(None, None, None)
    assert _first_token_s(base) < 0.5


def test_a_non_stream_client_that_hangs_up_frees_its_sequence(
    long_server: tuple[str, subprocess.Popen[bytes]],
) -> None:
    base = long_server[0]
    with httpx.Client(base_url=base, timeout=0.3) as http:
        for _ in range(2):
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
                http.post("/v1/completions", json=LONG)
    assert _first_token_s(base) < 0.5

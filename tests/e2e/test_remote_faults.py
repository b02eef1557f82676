"""Remote branches' faults, end to end: ``quantroute serve`` (a real process) whose
branches are on a fake upstream (``tests/upstream.py``) that fails on demand, in the
ways a real server will not: a stall before the first token, a 500, a malformed event,
an endless event, a dropped connection, a 400 with OpenAI's error body; and a client
that leaves mid-stream, seen from the upstream's side.

Each fault is a model of its own (so one fault's breaker is not another's): its
``good`` streams a healthy answer, its reference ``bad`` has the fault. Remote servers
that do not report their KV cache count as ample memory, where the most faithful
feasible branch fits best: unpinned requests ask ``quality: fast`` (which admits the
unprofiled ``good``), ``bad`` comes first and ``good`` second; pinned ones name
``MODEL:bad``."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from qrtest import serve_process
from upstream import ERROR_400, HUGE_BYTES, TEXT, FakeUpstream, upstream_thread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIRST_TOKEN_S = 1.0  # the stalling branches' remote.first_token_timeout_s

# model -> the bad branch's behaviour and remote options
FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "stall": ("stall", {"first_token_timeout_s": FIRST_TOKEN_S}),
    "stall-head": ("stall-after-head", {"first_token_timeout_s": FIRST_TOKEN_S}),
    "e500": ("http500", {}),
    "e400": ("http400", {}),
    "badjson": ("bad-json", {}),
    "huge": ("huge", {"max_event_bytes": 1 << 20}),
    "drop": ("drop", {}),
    "slow": ("slow", {}),
    "truncated": ("truncated", {}),
}


def _manifest(model: str, url: str, behaviour: str, options: dict[str, Any]) -> str:
    probe = {"probe_interval_s": 0.5}
    good = {"engine": "openai", "url": url, "precision": "q4_k_m", "remote_model": "ok",
            "remote": probe}  # fmt: skip
    bad = {"engine": "openai", "url": url, "precision": "f16", "remote_model": behaviour,
           "remote": probe | options}  # fmt: skip
    # a remote server without KV figures counts as ample: the reference fits best
    doc = {"model": model, "reference": "bad", "branches": {"good": good, "bad": bad}}
    return json.dumps(doc)  # JSON is YAML


@dataclass
class Gateway:
    base: str
    pid: int
    upstream: FakeUpstream

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    repo = tmp_path_factory.mktemp("remote-faults") / "repo"
    with upstream_thread() as up:
        for model, (behaviour, options) in FAULTS.items():
            (repo / model).mkdir(parents=True)
            (repo / model / "quantroute.yaml").write_text(
                _manifest(model, up.url, behaviour, options)
            )
        with pytest.MonkeyPatch.context() as env:
            env.setenv("QUANTROUTE_ENGINE__N_THREADS", "1")
            with serve_process(repo, ready_s=60) as base:
                port = int(base.rsplit(":", 1)[1])
                (proc,) = [p for p in psutil.Process().children() if str(port) in p.cmdline()]
                _wait_all_ready(base)
                yield Gateway(base, proc.pid, up)


def _wait_all_ready(base: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        branches = [b for m in models for b in m.get("branches", ())]
        if branches and all(b["ready"] for b in branches):
            return
        time.sleep(0.2)
    pytest.fail("the remote branches did not all become ready")


FAST: dict[str, Any] = {"quality": "fast"}


def _chat(model: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "stream": stream, **extra}  # fmt: skip


@dataclass
class Streamed:
    status: int
    headers: httpx.Headers
    events: list[Any]  # each data's JSON, or the string "[DONE]"
    seconds: float

    @property
    def text(self) -> str:
        return "".join(
            c.get("delta", {}).get("content") or ""
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", ())
        )

    @property
    def error(self) -> dict[str, Any] | None:
        last = self.events[-1] if self.events else None
        return last["error"] if isinstance(last, dict) and "error" in last else None


def _stream(gw: Gateway, body: dict[str, Any], timeout: float = 30.0) -> Streamed:
    started = time.monotonic()
    with (
        httpx.Client(timeout=timeout) as c,
        c.stream("POST", f"{gw.base}/v1/chat/completions", json=body) as r,
    ):
        events: list[Any] = []
        if r.status_code == 200:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        else:
            r.read()
            events.append(r.json())
    return Streamed(r.status_code, r.headers, events, time.monotonic() - started)


# -- before the first token --------------------------------------------------------------


@pytest.mark.parametrize("model", ["stall", "stall-head"])
def test_a_stall_before_the_first_token_falls_back(gateway: Gateway, model: str) -> None:
    started = time.monotonic()
    with gateway.client() as c:
        raw = c.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            extra_body=FAST,
        )  # fmt: skip
    took = time.monotonic() - started
    assert raw.headers["x-quantroute-branch"] == f"{model}:good"
    assert raw.parse().choices[0].message.content == "".join(TEXT)
    assert FIRST_TOKEN_S * 0.9 < took < FIRST_TOKEN_S + 5
    assert gateway.upstream.calls_of(FAULTS[model][0])  # it was tried first


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stall_when_pinned_is_a_clean_503(gateway: Gateway, stream: bool) -> None:
    got = _stream(gateway, _chat("stall:bad", stream), timeout=FIRST_TOKEN_S + 20)
    assert got.status == 503, got.events
    (error,) = got.events
    assert set(error["error"]) >= {"message", "type", "code"}
    assert got.seconds < FIRST_TOKEN_S + 5


def test_500s_fall_back_and_open_the_breaker(gateway: Gateway) -> None:
    """Each 500 moves the request to ``good``; five in a row open ``bad``'s breaker, and
    routing passes it over (the upstream sees no more of them)."""
    up = gateway.upstream
    with gateway.client() as c:
        for _ in range(5):
            raw = c.chat.completions.with_raw_response.create(
                model="e500", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                extra_body=FAST,
            )  # fmt: skip
            assert raw.headers["x-quantroute-branch"] == "e500:good"
            assert raw.parse().choices[0].message.content == "".join(TEXT)
        assert len(up.calls_of("http500")) == 5
        explained = httpx.post(
            f"{gateway.base}/v1/route/explain", json=_chat("e500", **FAST), timeout=10
        ).json()
        (bad,) = [b for b in explained["branches"] if b["branch"] == "e500:bad"]
        breaker = {f["name"]: f for f in bad["filters"]}["breaker"]
        assert not breaker["passed"], breaker
        c.chat.completions.create(
            model="e500", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            extra_body=FAST,
        )  # fmt: skip
        assert len(up.calls_of("http500")) == 5


@pytest.mark.parametrize("model", ["e400", "e400:bad"])
def test_an_upstream_400_passes_through_in_openai_s_shape(gateway: Gateway, model: str) -> None:
    """The request's own fault: the client gets it as the upstream said it, and it is not
    tried on another branch."""
    seen = len(gateway.upstream.calls)
    with gateway.client() as c, pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            extra_body=FAST if ":" not in model else {},
        )  # fmt: skip
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "context_length_exceeded"
    assert body["type"] == "invalid_request_error"
    assert ERROR_400["error"]["message"] in body["message"]
    assert [c.model for c in gateway.upstream.calls[seen:]] == ["http400"]  # no fallback


# -- after the first token ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["badjson", "drop"])
def test_a_broken_stream_ends_with_an_error_event(gateway: Gateway, model: str) -> None:
    got = _stream(gateway, _chat(f"{model}:bad", True), timeout=20)
    assert got.status == 200
    assert got.text.startswith(TEXT[0])  # the first token went out
    assert got.error is not None and got.error["message"], got.events[-3:]
    assert "[DONE]" not in got.events
    assert got.seconds < 10


@pytest.mark.parametrize("model", ["badjson", "drop"])
def test_a_broken_stream_whole_is_a_502(gateway: Gateway, model: str) -> None:
    got = _stream(gateway, _chat(f"{model}:bad"), timeout=20)
    assert got.status == 502, got.events
    assert set(got.events[0]["error"]) >= {"message", "type", "code"}


def test_a_stream_cut_short_upstream_is_not_a_silent_end(gateway: Gateway) -> None:
    got = _stream(gateway, _chat("truncated:bad", True), timeout=20)
    assert got.text == "".join(TEXT[:2])
    assert got.error is not None


def test_an_endless_event_costs_bounded_memory(gateway: Gateway) -> None:
    """The upstream offers one event of 256 MiB after the first token; the gateway reads
    at most ``max_event_bytes`` (1 MiB) of it, ends the stream with an error event, and
    its RSS never grows by anything near the event's size."""
    gw = psutil.Process(gateway.pid)
    before = gw.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], gw.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        got = _stream(gateway, _chat("huge:bad", True), timeout=30)
    finally:
        done.set()
        sampler.join()
    assert got.status == 200 and got.text.startswith(TEXT[0])
    assert got.error is not None and "[DONE]" not in got.events
    (call,) = gateway.upstream.calls_of("huge")
    assert call.gone.wait(5), "the upstream request was not closed"
    assert call.sent < 32 << 20 < HUGE_BYTES  # it stopped reading early
    grew = peak[0] - before
    assert grew < 48 << 20, f"the gateway's RSS grew by {grew / 2**20:.0f} MiB"


def test_a_client_that_leaves_closes_the_upstream_request(gateway: Gateway) -> None:
    up = gateway.upstream
    with (
        httpx.Client(timeout=10) as c,
        c.stream("POST", f"{gateway.base}/v1/chat/completions",
                 json=_chat("slow:bad", True, max_tokens=1000)) as r,
    ):  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
        (call,) = up.calls_of("slow")
        left = time.monotonic()
    # the response is closed: the connection to the gateway is gone
    assert call.gone.wait(5), "the upstream request outlived the client"
    assert call.closed is not None and call.closed - left < 2.0
    assert call.sent < 200 * 200  # ~20 tokens of ~150 bytes: far from its 1200


def test_every_fault_left_the_gateway_healthy(gateway: Gateway) -> None:
    """After all of the above: it answers, and a healthy request works."""
    assert httpx.get(f"{gateway.base}/health", timeout=5).status_code == 200
    with gateway.client() as c:
        r = c.chat.completions.create(
            model="slow:good", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    assert r.choices[0].message.content == "".join(TEXT)
    assert r.model == "slow:good"


def test_a_remote_branch_beside_simulated_devices(tmp_path: Path) -> None:
    with upstream_thread() as up:
        (tmp_path / "repo" / "sim").mkdir(parents=True)
        (tmp_path / "repo" / "sim" / "quantroute.yaml").write_text(
            _manifest("sim", up.url, "ok", {})
        )
        with serve_process(tmp_path / "repo", "--devices", "sim:1x24GiB", ready_s=60) as base:
            r = httpx.post(f"{base}/v1/chat/completions", json=_chat("sim:bad"), timeout=10)
            assert r.status_code == 200

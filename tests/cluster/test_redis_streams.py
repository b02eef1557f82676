"""Streams shared through Redis (``cluster/redis_streams.py``), on a real redis-server: a
stream started on one gateway and dropped is resumed on another with exactly the rest; a
stream whose gateway dies resumes elsewhere to what it produced, then an error event; the
owner and the token hold on every gateway; Redis down never touches the local stream.

The end-to-end tests run two gateway processes of this file's launcher (``python
tests/cluster/test_redis_streams.py serve ...``: the real app over fake engines, with
the Redis wiring the composition root will have, ``_serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import FastAPI, Header, Query, Request

from cluster_servers import RedisServer, needs_redis
from qrtest import StreamSource, fake_table, free_port
from quantroute.api import routes
from quantroute.api.auth import is_open
from quantroute.api.sse import EventStreamResponse
from quantroute.cluster.redis_link import RedisLink, RedisTimings
from quantroute.cluster.redis_stream_reader import LOST, PRODUCER_LOST
from quantroute.cluster.redis_streams import StreamReplicator
from quantroute.config import StreamSettings
from quantroute.engines.fake import FakeEngine
from quantroute.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from quantroute.resilience.resume import Stream, StreamStore

pytestmark = needs_redis

FAST = RedisTimings(heartbeat_s=0.2, heartbeat_ttl_s=1.0, read_block_s=0.2)
ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def gateway(
    url: str, settings: StreamSettings | None = None
) -> AsyncIterator[tuple[StreamStore, StreamReplicator, RedisLink]]:
    """One gateway's stream store, copying to (and reading from) the Redis at ``url``."""
    settings = settings or StreamSettings()
    link = RedisLink(url, "qrtest", FAST)
    await link.start()
    replicator = StreamReplicator(link, settings)
    replicator.start()
    store = StreamStore(settings, replicator)
    try:
        yield store, replicator, link
    finally:
        await store.close()
        await replicator.close()
        await link.close()


def _open(
    store: StreamStore, key: str = "job-1", owner: str = "acme"
) -> tuple[Stream, StreamSource]:
    source = StreamSource()
    stream = store.open(key, owner, source.events(), close=source.close, grace_s=10.0)
    return stream, source


async def _read(
    stream: Stream, after: int | None, count: int | None = None
) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    async for item in stream.follow(after, keepalive_s=5):
        assert item is not None
        out.append(item)
        if count is not None and len(out) == count:
            break
    return out


async def _until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (what it waits for has no event)
            await asyncio.sleep(0.005)


async def _copied(replicator: StreamReplicator) -> None:
    """Wait until what the stores handed to ``replicator`` was sent."""
    await asyncio.sleep(0.01)  # the producer's task appends what was put
    await _until(lambda: replicator.idle)


async def test_a_stream_dropped_on_a_is_resumed_on_b_with_exactly_the_rest(
    redis_server: RedisServer,
) -> None:
    async with gateway(redis_server.url) as (a, a_out, _), gateway(redis_server.url) as (b, _, _):
        stream, source = _open(a)
        source.put(*(b"e%d" % i for i in range(10)))
        seen = await _read(stream, None, count=4)  # the client reads four on A, and drops
        assert [s for s, _ in seen] == [0, 1, 2, 3]
        await _copied(a_out)
        resumed = await b.find("job-1", "acme", after=3, token=stream.token, token_required=True)
        rest = asyncio.create_task(_read(resumed, 3))
        await asyncio.sleep(0.1)
        source.put(b"e10", b"e11")  # produced on A while B follows: the live tail
        source.put_together(b"e12", b"[DONE]")
        source.finish()
        got = await asyncio.wait_for(rest, 10)
        assert got == [(s, b"e%d" % s) for s in range(4, 13)] + [(13, b"[DONE]")]
        # the finished copy replays whole on B, and from any event on
        whole = await _read(await b.find("job-1", "acme"), None)
        assert whole == await _read(a.get("job-1", "acme"), None)
        assert await _read(await b.find("job-1", "acme", after=12), 12) == [(13, b"[DONE]")]


async def test_the_owner_and_the_token_hold_on_every_gateway(redis_server: RedisServer) -> None:
    async with gateway(redis_server.url) as (a, a_out, _), gateway(redis_server.url) as (b, _, _):
        stream, source = _open(a, owner="acme")
        source.put(b"x")
        await _copied(a_out)
        for owner, token, required in [
            ("other", stream.token, False),  # another tenant's: unknown to it
            ("acme", None, True),  # an open API: without the token
            ("acme", "0" * 32, False),  # a token, but not the stream's
            ("acme", stream.token + "x", True),
        ]:
            with pytest.raises(NotFoundError) as info:
                await b.find("job-1", owner, token=token, token_required=required)
            assert info.value.error_code == "stream_not_found"
        with pytest.raises(NotFoundError):
            await b.find("job-2", "acme")  # no such stream anywhere
        ok = await b.find("job-1", "acme", token=stream.token, token_required=True)
        assert (await _read(ok, None, count=1)) == [(0, b"x")]
        source.finish()


async def test_a_resume_waits_for_what_the_copy_does_not_have_yet(
    redis_server: RedisServer,
) -> None:
    """A client that saw an event on A before it was copied resumes on B from it: B waits
    for it (a live copy lags its producer by a batch), then, once the copy ended, says
    the id is past it."""
    async with gateway(redis_server.url) as (a, a_out, _), gateway(redis_server.url) as (b, _, _):
        _, source = _open(a)
        source.put(b"a", b"b")
        await _copied(a_out)
        ahead = await b.find("job-1", "acme", after=5)  # past the copy: it waits
        follow = asyncio.create_task(_read(ahead, 5))
        source.put(*(b"%d" % i for i in range(2, 8)))
        source.finish()
        assert await asyncio.wait_for(follow, 10) == [(6, b"6"), (7, b"7")]
        await _copied(a_out)
        past = await b.find("job-1", "acme", after=20)
        assert past.next_seq == 8 and past.done  # the route answers 400 for after >= next_seq
        assert await _read(await b.find("job-1", "acme", after=7), 7) == []


async def test_a_stream_shed_on_its_gateway_is_gone_from_the_copy(
    redis_server: RedisServer,
) -> None:
    settings = StreamSettings(max_streams=1)
    async with (
        gateway(redis_server.url, settings) as (a, a_out, _),
        gateway(redis_server.url, settings) as (b, _, _),
    ):
        first, source = _open(a, "job-1")
        source.put(b"x")
        source.finish()
        await _read(first, None)
        await _copied(a_out)
        assert await _read(await b.find("job-1", "acme"), None) == [(0, b"x")]
        _, second = _open(a, "job-2")  # over max_streams: job-1 is dropped, and its copy
        await _copied(a_out)
        with pytest.raises(NotFoundError):
            await b.find("job-1", "acme")
        second.finish()


async def test_a_producer_that_dies_ends_its_resumes_with_an_error_event(
    redis_server: RedisServer,
) -> None:
    """In-process: A stops renewing its heartbeat and copying (as a killed process does);
    B's resume gets what was copied, then ``stream_producer_lost``, never a silent end."""
    async with gateway(redis_server.url) as (b, _, _):
        link = RedisLink(redis_server.url, "qrtest", FAST)
        await link.start()
        a_out = StreamReplicator(link, StreamSettings())
        a_out.start()
        a = StreamStore(StreamSettings(), a_out)
        _, source = _open(a)
        source.put(b"a", b"b", b"c")
        await _copied(a_out)
        resumed = await b.find("job-1", "acme", after=0)
        follow = asyncio.create_task(_read(resumed, 0))
        for task in (link._task, a_out._task):  # the gateway dies: nothing more from it
            assert task is not None
            task.cancel()
        started = time.monotonic()
        got = await asyncio.wait_for(follow, 10)
        assert got == [(1, b"b"), (2, b"c"), (3, PRODUCER_LOST)]
        assert time.monotonic() - started < FAST.heartbeat_ttl_s + 2 * FAST.read_block_s + 2
        source.finish()
        await a.close()
        await link.client.aclose()
        await link.reader.aclose()


async def test_redis_down_never_touches_the_local_stream(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis killed mid-stream: the stream's own readers get every event at once; the copy
    holds what waits (bounded) and sends it once Redis is back, so a restarted (empty)
    Redis holds the rest of the live stream, and new streams are copied as before."""
    async with (
        gateway(redis_server.url) as (a, a_out, a_link),
        gateway(redis_server.url) as (b, _, _),
    ):
        stream, source = _open(a)
        source.put(b"0", b"1")
        await _copied(a_out)
        redis_server.kill()
        reader = asyncio.create_task(_read(stream, None))
        for i in range(2, 200):
            source.put(b"%d" % i)
        source.put_together(b"[DONE]")
        source.finish()
        local = await asyncio.wait_for(reader, 5)  # served locally without waiting on Redis
        assert [d for _, d in local] == [b"%d" % i for i in range(200)] + [b"[DONE]"]
        await _until(lambda: not a_link.up)
        assert a_out.pending_bytes > 0  # held for Redis, not lost: within the bound
        assert "Redis unreachable" in caplog.text
        with pytest.raises(ServiceUnavailableError):  # B cannot read copies without Redis
            await b.find("job-1", "acme", after=150)
        redis_server.start()  # empty: what was copied before is gone
        await _until(lambda: a_link.up and not a_out.pending_bytes and a_out.idle)
        tail = await b.find("job-1", "acme", after=150)
        assert await _read(tail, 150) == local[151:] and local[-1][1] == b"[DONE]"
        with pytest.raises(NotFoundError) as info:
            await b.find("job-1", "acme", after=0)  # the events copied before the restart
        assert info.value.error_code == "stream_events_gone"
        assert a_out.dropped == 0


async def test_a_copy_that_falls_behind_ends_with_lost_not_silence(
    redis_server: RedisServer,
) -> None:
    """Past the bound on what waits for Redis, a stream's copy stops: a reader elsewhere
    gets what was copied, then ``stream_events_lost``; the stream itself is whole."""
    async with (
        gateway(redis_server.url) as (a, a_out, a_link),
        gateway(redis_server.url) as (b, _, _),
    ):
        stream, source = _open(a)
        source.put(b"0")
        await _copied(a_out)
        resumed = await b.find("job-1", "acme", after=None)
        follow = asyncio.create_task(_read(resumed, None))
        a_out.max_pending_bytes = 64  # as if Redis had been slow for a while
        assert a_link._task is not None
        a_link._task.cancel()  # no renewal says Redis is back until this test does
        a_link.up = False
        big = b"y" * 40
        source.put(big, big, big, big)
        source.put_together(b"[DONE]")
        source.finish()
        assert [d for _, d in await _read(stream, None)] == [b"0", big, big, big, big, b"[DONE]"]
        assert a_out.dropped == 3  # the two after the bound, and [DONE]
        await a_link.renew()  # Redis answers: what waited is sent, then the lost mark
        got = await asyncio.wait_for(follow, 10)
        assert got == [(0, b"0"), (1, big), (2, big), (3, LOST)]


# -- end to end: two gateway processes ---------------------------------------------------


def _events(body: bytes) -> list[tuple[str, bytes]]:
    """An SSE body's events: (id, data)."""
    out = []
    for block in body.split(b"\n\n"):
        fields = dict(
            line.split(b": ", 1)
            for line in block.split(b"\n")
            if b": " in line and line[:1] != b":"
        )
        if b"data" in fields:
            out.append((fields.get(b"id", b"").decode(), fields[b"data"]))
    return out


@contextlib.contextmanager
def gateway_process(
    redis_url: str, token_delay_s: float, tenants_file: Path | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """This file's launcher as a gateway process of the fleet at ``redis_url``: its base
    URL once ready, and the process."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    argv = [sys.executable, __file__, "serve", str(port), redis_url, str(token_delay_s),
            str(tenants_file or "")]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, "the gateway exited while starting"
            time.sleep(0.2)
        else:
            pytest.fail("the gateway did not become ready")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start(base: str, seen: int) -> tuple[str, str, list[tuple[str, bytes]]]:
    """A resumable streamed request to ``base``, dropped after ``seen`` events: its id, its
    token and the events it read."""
    body = {"model": "tiny-llama", "stream": True, "max_tokens": 120,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    headers = {"x-quantroute-resumable": "true"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        token = r.headers["x-quantroute-stream-token"]
        got = b""
        for chunk in r.iter_bytes():
            got += chunk
            if len(_events(got)) >= seen:
                break
    events = _events(got)[:seen]
    return events[0][0].rsplit("/", 1)[0], token, events


def _resume(base: str, key: str, after: str, token: str | None) -> httpx.Response:
    headers = {"last-event-id": after}
    if token is not None:
        headers["x-quantroute-stream-token"] = token
    return httpx.get(f"{base}/v1/streams/{key}", headers=headers, timeout=60)


@pytest.mark.e2e
@pytest.mark.slow
def test_e2e_a_stream_dropped_on_one_gateway_is_resumed_on_another(
    redis_server: RedisServer,
) -> None:
    with (
        gateway_process(redis_server.url, 0.02) as (a, _),
        gateway_process(redis_server.url, 0.02) as (b, _),
    ):
        key, token, first = _start(a, 5)
        assert _resume(b, key, first[-1][0], None).status_code == 404  # an open API: no token
        rest = _resume(b, key, first[-1][0], token)
        assert rest.status_code == 200
        got = _events(rest.content)
        assert got[-1][1] == b"[DONE]"
        whole = _events(_resume(a, key, f"{key}/0", token).content)  # A's own, after event 0
        assert first[1:] + got == whole
        assert [int(i.rsplit("/", 1)[1]) for i, _ in first + got] == list(range(len(first + got)))


@pytest.mark.e2e
@pytest.mark.slow
def test_e2e_a_stream_whose_gateway_is_killed_resumes_elsewhere_then_errors(
    redis_server: RedisServer,
) -> None:
    with (
        gateway_process(redis_server.url, 0.05) as (a, a_proc),
        gateway_process(redis_server.url, 0.05) as (b, _),
    ):
        key, token, first = _start(a, 3)
        time.sleep(1.0)  # A goes on producing for the client that left
        a_proc.send_signal(signal.SIGKILL)
        a_proc.wait()
        rest = _resume(b, key, first[-1][0], token)
        assert rest.status_code == 200
        got = _events(rest.content)
        assert len(got) >= 5, "what A produced in that second was copied"
        seqs = [int(i.rsplit("/", 1)[1]) for i, _ in got]
        assert seqs == list(range(3, 3 + len(got)))
        assert all(d != b"[DONE]" for _, d in got)
        error = json.loads(got[-1][1])["error"]
        assert error["code"] == "stream_producer_lost"


# -- the launcher: a gateway process with the Redis wiring --------------------------------


async def _resume_route(
    request: Request,
    stream_id: str,
    tenant: routes.Client,
    starting_after: Annotated[str | None, Query()] = None,
    last_event_id: Annotated[str | None, Header()] = None,
    x_quantroute_stream_token: Annotated[str | None, Header()] = None,
) -> EventStreamResponse:
    """``routes.resume_stream`` with the one change the wiring makes: ``await find``."""
    key = stream_id.removeprefix("chatcmpl-").removeprefix("cmpl-")
    after = routes._resume_after(key, last_event_id, routes._seq(starting_after, "starting_after"))
    stream = await routes._streams(request).find(
        key, tenant.name, after, token=x_quantroute_stream_token, token_required=is_open(request)
    )
    if after is not None and after >= stream.next_seq:
        raise InvalidRequestError("that event id is past this stream's last event")
    return routes._sse(request, stream, after)


def _serve(port: int, redis_url: str, token_delay_s: float, tenants_file: str) -> None:
    """The real app over fake engines with ``cluster.redis_url`` (what the composition
    root wires of it), and the stream store's wiring made here: a store copying to Redis,
    and the resume route awaiting ``StreamStore.find``."""
    import uvicorn

    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    overrides: dict[str, Any] = {
        "telemetry": {"devices": "sim:1x24GiB"},
        "limits": {"max_tokens": 128},
        "cluster": {"redis_url": redis_url, "name": "qrtest"},
    }
    if tenants_file:
        overrides["auth"] = {"tenants_file": tenants_file}
    settings = load_settings(**overrides)
    text = "".join(chr(97 + i % 26) for i in range(200))
    engines = {n: FakeEngine(text, token_delay_s=token_delay_s) for n in ("f16", "q8_0", "q4_k_m")}
    app: FastAPI = create_app(settings, fake_table(engines))
    link = RedisLink(redis_url, "qrtest", FAST)
    replicator = StreamReplicator(link, settings.streams)
    store = app.state.streams = StreamStore(settings.streams, replicator)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await link.start()
        replicator.start()
        async with inner(app):
            try:
                yield
            finally:
                await store.close()
        await replicator.close()
        await link.close()

    app.router.lifespan_context = lifespan
    app.add_api_route("/v1/streams/{stream_id}", _resume_route, methods=["GET"])
    app.router.routes.insert(0, app.router.routes.pop())  # before the one that only gets
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5])

"""Many streams at once over real sockets, read by clients that misbehave in every way a
network lets them: fast, slowly through small buffers (so uvicorn's flow control pauses
the writes), dropping and resuming with ``Last-Event-ID``, watching a stream another client
is reading, or leaving for good; over fake engines, and over a real llama.cpp worker,
whose tokens go out from the task that reads its pipe. Whether a chunk went out through
``send`` or straight from the task that had it (``api/direct.py``), every stream read to
its end must arrive whole: valid chunked framing, events numbered without a gap or a
repeat, every token counted (and over the fake engines the very text they make), the same
events for every reader of one stream, ``[DONE]`` last, and the connection fit for its
next request. Nothing may keep generating for a client that left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI

from qrtest import ADMIN_KEY, fake_table, live
from quantroute.api.app import create_app
from quantroute.api.direct import DirectBody
from quantroute.config import DEMO_REPO, Settings, load_settings
from quantroute.engines.fake import FakeEngine

TEXT = "def fake():\n    return 42\n"  # FakeEngine's, a character a token


def made(n: int) -> str:
    """What the fake engine makes for ``max_tokens`` n."""
    return "".join(TEXT[i % len(TEXT)] for i in range(n))


@dataclass(frozen=True)
class Workload:
    """What the clients ask for, and what a whole stream of n tokens must say."""

    body: dict[str, Any]  # every request's fields but max_tokens and stream
    sizes: tuple[int, ...]  # max_tokens, one drawn per stream
    stall_tokens: int  # a stalling reader's stream: long enough to fill its socket
    text: Callable[[int], str] | None  # the text of n tokens, where it is known


FAKE = Workload({"model": "tiny-llama", "prompt": "chaos"}, (8, 60, 300, 900), 3000, made)
LLAMA = Workload(  # greedy and never stopping early: a stream of n tokens has n
    {"model": "tiny-llama:q8_0", "prompt": "def ", "temperature": 0.0, "ignore_eos": True},
    sizes=(8, 40, 160, 400),
    stall_tokens=480,
    text=None,
)


def chaos_settings(window: int, **more: Any) -> Settings:
    return load_settings(
        server={"admin_key": ADMIN_KEY, "keepalive_s": 0.05},  # keep-alives among the writes
        # a short window holds a slow reader's producer back before its socket fills; a long
        # one lets the socket fill. A long grace: a generation left running for a client
        # that left is still running at the check
        streams={"max_events_per_stream": window, "resume_grace_s": 60.0},
        admission={"queue_size": 256},
        **more,
    )


@dataclass
class Event:
    id: str | None
    data: str
    retry: str | None


@dataclass
class Read:
    """What one response brought: its head, its events and comments, and how it ended."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    comments: int = 0
    ended: bool = False  # the terminating chunk came


class Conn:
    """One HTTP/1.1 connection, read as strictly as a careful client would."""

    def __init__(self, port: int, rng: random.Random, *, slow: bool):
        self.port = port
        self.rng = rng
        self.slow = slow

    async def open(self) -> None:
        sock = socket.socket()
        try:
            if self.slow:  # a small window: the server's socket buffer fills behind it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
            limit = 1024 if self.slow else 1 << 16  # asyncio stops reading past twice this
            self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=limit)
        except BaseException:
            sock.close()
            raise

    def request(self, method: str, path: str, body: Any = None, **headers: str) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        head = [f"{method} {path} HTTP/1.1", "host: localhost", f"content-length: {len(data)}"]
        head += ["content-type: application/json"] * (body is not None)
        head += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)

    async def head(self, read: Read) -> None:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status, *lines = raw.decode("latin-1").split("\r\n")[:-2]
        assert status.startswith("HTTP/1.1 "), status
        read.status = int(status.split()[1])
        read.headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}

    async def body(self, read: Read) -> AsyncIterator[bytes]:
        """The body's pieces: chunked framing checked byte by byte, or a content-length."""
        if read.headers.get("transfer-encoding") != "chunked":
            yield await self.reader.readexactly(int(read.headers["content-length"]))
            read.ended = True
            return
        while True:
            line = await self.reader.readuntil(b"\r\n")
            size = line[:-2]
            assert size and all(c in b"0123456789abcdef" for c in size), line
            if int(size, 16) == 0:
                assert await self.reader.readexactly(2) == b"\r\n"  # no trailers
                read.ended = True
                return
            chunk = await self.reader.readexactly(int(size, 16))
            assert await self.reader.readexactly(2) == b"\r\n", "a chunk's length was wrong"
            yield chunk
            if self.slow:  # a reader that lags, and now and then stops a while
                await asyncio.sleep(
                    self.rng.choice((0, 0, 0, 0.001, 0.004, 0.3 * (self.rng.random() < 0.02)))
                )

    async def events(self, read: Read, limit: int | None = None) -> None:
        """Read SSE events into ``read`` to the end, or until ``limit`` of them came."""
        pending = b""
        async for chunk in self.body(read):
            pending += chunk
            while b"\n\n" in pending:
                block, pending = pending.split(b"\n\n", 1)
                fields: dict[str, str] = {}
                for line in block.decode().split("\n"):
                    if line.startswith(":"):
                        read.comments += 1
                    else:
                        name, _, value = line.partition(": ")
                        assert name not in fields, block
                        fields[name] = value
                if "data" in fields:
                    read.events.append(Event(fields.get("id"), fields["data"], fields.get("retry")))
                    if limit is not None and len(read.events) >= limit:
                        return
        assert pending == b"", pending  # nothing after the last event

    def abort(self) -> None:
        """Gone at once (a reset, as a client that dies sends); again is nothing."""
        if hasattr(self, "writer"):
            self.writer.transport.abort()


def check_whole(reads: list[Read], job: str, n: int, work: Workload) -> None:
    """The reads of one stream, in the order made (a drop, its resumes), are all of it."""
    events = [e for r in reads for e in r.events]
    assert [e.id for e in events] == [f"{job}/{i}" for i in range(len(events))]
    assert events[-1].data == "[DONE]" and reads[-1].ended
    chunks = [json.loads(e.data) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == n  # the usage chunk, last
    choices = [c for chunk in chunks for c in chunk["choices"]]
    text = "".join(c["text"] for c in choices)
    if work.text is not None:
        assert text == work.text(n)
    if any(c.get("logprobs") for c in choices):  # one entry a token, in order
        tokens = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["tokens"]]
        assert len(tokens) == n and "".join(tokens) == text
    for r in reads:  # each response's first event says how soon to reconnect, and only it
        assert [e.retry is not None for e in r.events] == [True] + [False] * (len(r.events) - 1)


def done(reads: list[Read]) -> bool:
    return any(e.data == "[DONE]" for e in reads[-1].events)


async def play(
    port: int, rng: random.Random, work: Workload, kinds: tuple[str, ...], stats: dict[str, int]
) -> None:
    """One client: a stream read in one of the ways, checked, then the connection reused."""
    kind = rng.choice(kinds)
    n = work.stall_tokens if kind == "stall" else rng.choice(work.sizes)
    slow = kind in ("slow", "stall", "watch") or rng.random() < 0.3
    body = work.body | {"max_tokens": n, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if kind == "stall" or rng.random() < 0.2:  # bigger events, rendered the long way
        body["logprobs"] = 2
    resumable = {"x_quantroute_resumable": "true"} if kind in ("drop", "watch") else {}
    conns = [Conn(port, rng, slow=slow)]
    try:
        conn = conns[0]
        await conn.open()
        conn.request("POST", "/v1/completions", body, **resumable)
        first = Read()
        await conn.head(first)
        assert first.status == 200, first.headers
        job = first.headers["x-request-id"]
        token = first.headers["x-quantroute-stream-token"]  # a resume shows it (open API)
        stats[kind] += 1

        if kind == "leave":  # a few events, then gone for good
            await conn.events(first, limit=rng.randint(1, 4))
            conn.abort()
            return
        if kind == "drop":  # gone mid-stream, back with Last-Event-ID, perhaps more than once
            reads = [first]
            await conn.events(first, limit=rng.randint(1, max(1, n // 3)))
            while not done(reads):
                conn.abort()
                await asyncio.sleep(rng.choice((0, 0.01, 0.05)))
                conn = Conn(port, rng, slow=rng.random() < 0.5)
                conns.append(conn)
                await conn.open()
                last = reads[-1].events[-1].id or ""
                conn.request(
                    "GET", f"/v1/streams/{job}", last_event_id=last, x_quantroute_stream_token=token
                )
                again = Read()
                await conn.head(again)
                assert again.status == 200, again.headers
                reads.append(again)
                await conn.events(again, limit=None if rng.random() < 0.5 else rng.randint(1, n))
                stats["resumed"] += 1
            if not reads[-1].ended:  # [DONE] came, the body's last chunk not yet
                await conn.events(reads[-1])
            check_whole(reads, job, n, work)
        elif kind == "watch":  # a second reader from the start while the first still reads
            other = Conn(port, rng, slow=False)
            conns.append(other)
            await other.open()
            other.request("GET", f"/v1/streams/{job}", x_quantroute_stream_token=token)
            seen = Read()
            await other.head(seen)
            assert seen.status == 200, seen.headers
            await asyncio.gather(conn.events(first), other.events(seen))
            check_whole([first], job, n, work)
            check_whole([seen], job, n, work)
            assert [e.data for e in seen.events] == [e.data for e in first.events]
        else:
            if kind == "stall":  # reads nothing for a while: the server's socket fills
                await asyncio.sleep(1.0)
            await conn.events(first)
            check_whole([first], job, n, work)

        # the connection carries on: its next bytes are the next response's, nothing stray
        conn.request("POST", "/v1/completions", work.body | {"max_tokens": 5})
        after = Read()
        await conn.head(after)
        assert after.status == 200
        whole = json.loads(b"".join([piece async for piece in conn.body(after)]))
        assert whole["usage"]["completion_tokens"] == 5
        assert work.text is None or whole["choices"][0]["text"] == work.text(5)
    except Exception as exc:  # say which client it was
        raise AssertionError(f"a {kind!r} client of {n} tokens (slow: {slow})") from exc
    finally:
        for c in conns:
            c.abort()


KINDS = ("fast", "slow", "stall", "drop", "watch", "leave")


class Direct:
    """``DirectBody.write`` counted, over sockets with a small send buffer: a slow network,
    so a reader that stalls fills its socket and uvicorn's flow control pauses the writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.written = 0
        self.refused_full = 0  # refused because the socket's buffer was full
        narrowed: set[int] = set()
        real = DirectBody.write

        def counted(body: DirectBody, data: bytes) -> bool:
            if id(body) not in narrowed:
                narrowed.add(id(body))
                sock = body._transport.get_extra_info("socket")
                with contextlib.suppress(OSError):  # a client already gone: nothing to narrow
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # no autotuning
            full = body._open and body._cycle.flow.write_paused
            ok = real(body, data)
            self.written += ok
            self.refused_full += full
            return ok

        monkeypatch.setattr(DirectBody, "write", counted)


async def run_clients(
    app: FastAPI, work: Workload, kinds: tuple[str, ...], clients: int, seed: int
) -> dict[str, int]:
    """``clients`` clients at once, each reading one way; then every engine idle."""
    rng = random.Random(seed)
    stats = dict.fromkeys(kinds, 0) | {"resumed": 0 if "drop" in kinds else 1}
    # a keep-alive connection outlives a slow reader's last chunks (uvicorn's default: 5 s
    # after the server wrote them), so its next request finds it open
    async with live(app, timeout_keep_alive=60) as port:
        async with asyncio.timeout(120), asyncio.TaskGroup() as group:  # one fails: all stop
            for _ in range(clients):
                group.create_task(play(port, random.Random(rng.random()), work, kinds, stats))
        # every generation ends: a client that left cancelled its own, none waits on grace
        engines = [b.engine for b in app.state.gateway.routes.current.branches()]
        for _ in range(500):
            if all(e.in_flight == 0 for e in engines):
                break
            await asyncio.sleep(0.01)
        assert [e.in_flight for e in engines] == [0] * len(engines)
    return stats


# A window of 64 keeps 8 events behind a reader that dropped (``Stream._ahead``), fewer than
# a socket's buffers hold, so its drops may come back to a 404 by design: it plays no drops.
@pytest.mark.slow
@pytest.mark.parametrize(("seed", "window"), [(1, 64), (2, 64), (3, 4096), (4, 4096)])
async def test_streams_read_every_way_at_once_arrive_whole_and_leave_nothing_running(
    monkeypatch: pytest.MonkeyPatch, seed: int, window: int
) -> None:
    direct = Direct(monkeypatch)
    engines = {n: FakeEngine(n_ctx=4096, token_delay_s=0.0005) for n in ("f16", "q8_0", "q4_k_m")}
    settings = chaos_settings(window, telemetry={"devices": "sim:1x24GiB"})
    kinds = tuple(k for k in KINDS if k != "drop" or window > 64)
    stats = await run_clients(
        create_app(settings, fake_table(dict(engines))), FAKE, kinds, 40, seed
    )
    assert min(stats.values()) > 0, stats  # every way of reading was played
    # both paths carried events: written where they were made, and (where the window lets
    # a slow reader's socket fill before its producer waits) through send past a full one
    assert direct.written > 100 and (direct.refused_full > 0 or window < 100), vars(direct)


@pytest.mark.slow
async def test_a_llamacpp_workers_streams_read_every_way_at_once_arrive_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct = Direct(monkeypatch)
    engine = {"parallel": 8, "n_threads": 1}
    app = create_app(chaos_settings(4096, repo=DEMO_REPO, engine=engine))
    stats = await run_clients(app, LLAMA, KINDS, 20, seed=5)
    assert min(stats.values()) > 0, stats
    # whether a slow reader's socket fills before its stream ends depends on the worker's
    # pace against the reader's (it did in some runs, not in others, on one machine): the
    # path past a full socket is pinned by the fake engines' run above; here, the direct one
    assert direct.written > 100, vars(direct)

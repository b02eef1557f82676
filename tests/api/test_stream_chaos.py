"""Many streams at once over real sockets, read by clients that misbehave in every way a
network lets them: fast, slowly through small buffers (so uvicorn's flow control pauses
the writes), dropping and resuming with ``Last-Event-ID``, watching a stream another client
is reading, or leaving for good. Whether a chunk went out through ``send`` or straight
from the producer's task (``api/direct.py``), every stream read to its end must arrive
whole: valid chunked framing, events numbered without a gap or a repeat, the text the
engine made, ``[DONE]`` last, and the connection fit for its next request. Nothing may
keep generating for a client that left."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI

from qrtest import ADMIN_KEY, fake_table, live
from quantroute.api.direct import DirectBody
from quantroute.engines.fake import FakeEngine

TEXT = "def fake():\n    return 42\n"  # FakeEngine's, a character a token
PROMPT = "chaos"


def made(n: int) -> str:
    """What the engine makes for ``max_tokens`` n."""
    return "".join(TEXT[i % len(TEXT)] for i in range(n))


def chaos_app(engines: dict[str, FakeEngine], window: int) -> FastAPI:
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY, "keepalive_s": 0.05},  # keep-alives among the writes
        # a short window holds a slow reader's producer back before its socket fills; a long
        # one lets the socket fill. A long grace: a generation left running for a client
        # that left is still running at the check
        streams={"max_events_per_stream": window, "resume_grace_s": 60.0},
        admission={"queue_size": 256},
    )
    return create_app(settings, fake_table(dict(engines)))


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
        head = [f"{method} {path} HTTP/1.1", "host: chaos", f"content-length: {len(data)}"]
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


def text_of(events: list[Event]) -> str:
    return "".join(
        c["text"] for e in events if e.data != "[DONE]" for c in json.loads(e.data)["choices"]
    )


def check_whole(reads: list[Read], job: str, n: int) -> None:
    """The reads of one stream, in the order made (a drop, its resumes), are all of it."""
    events = [e for r in reads for e in r.events]
    assert [e.id for e in events] == [f"{job}/{i}" for i in range(len(events))]
    assert events[-1].data == "[DONE]" and reads[-1].ended
    assert text_of(events) == made(n)
    for r in reads:  # each response's first event says how soon to reconnect, and only it
        assert [e.retry is not None for e in r.events] == [True] + [False] * (len(r.events) - 1)


def done(reads: list[Read]) -> bool:
    return any(e.data == "[DONE]" for e in reads[-1].events)


async def play(
    port: int, rng: random.Random, kinds: tuple[str, ...], stats: dict[str, int]
) -> None:
    """One client: a stream read in one of the ways, checked, then the connection reused."""
    kind = rng.choice(kinds)
    n = 3000 if kind == "stall" else rng.choice((8, 60, 300, 900))
    slow = kind in ("slow", "stall", "watch") or rng.random() < 0.3
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": n, "stream": True}
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
                conn.request("GET", f"/v1/streams/{job}", last_event_id=last)
                again = Read()
                await conn.head(again)
                assert again.status == 200, again.headers
                reads.append(again)
                await conn.events(again, limit=None if rng.random() < 0.5 else rng.randint(1, n))
                stats["resumed"] += 1
            if not reads[-1].ended:  # [DONE] came, the body's last chunk not yet
                await conn.events(reads[-1])
            check_whole(reads, job, n)
        elif kind == "watch":  # a second reader from the start while the first still reads
            other = Conn(port, rng, slow=False)
            conns.append(other)
            await other.open()
            other.request("GET", f"/v1/streams/{job}")
            seen = Read()
            await other.head(seen)
            assert seen.status == 200, seen.headers
            await asyncio.gather(conn.events(first), other.events(seen))
            check_whole([first], job, n)
            check_whole([seen], job, n)
        else:
            if kind == "stall":  # reads nothing for a while: the server's socket fills
                await asyncio.sleep(1.0)
            await conn.events(first)
            check_whole([first], job, n)

        # the connection carries on: its next bytes are the next response's, nothing stray
        conn.request("POST", "/v1/completions", body | {"stream": False, "max_tokens": 5})
        after = Read()
        await conn.head(after)
        assert after.status == 200
        whole = b"".join([piece async for piece in conn.body(after)])
        assert json.loads(whole)["choices"][0]["text"] == made(5)
    except Exception as exc:  # say which client it was
        raise AssertionError(f"a {kind!r} client of {n} tokens (slow: {slow})") from exc
    finally:
        for c in conns:
            c.abort()


KINDS = ("fast", "slow", "stall", "drop", "watch", "leave")


# A window of 64 keeps 8 events behind a reader that dropped (``Stream._ahead``), fewer than
# a socket's buffers hold, so its drops may come back to a 404 by design: it plays no drops.
@pytest.mark.slow
@pytest.mark.parametrize(("seed", "window"), [(1, 64), (2, 64), (3, 4096), (4, 4096)])
async def test_streams_read_every_way_at_once_arrive_whole_and_leave_nothing_running(
    monkeypatch: pytest.MonkeyPatch, seed: int, window: int
) -> None:
    direct = {"written": 0, "refused_full": 0}
    real = DirectBody.write
    narrowed: set[int] = set()

    def counted(self: DirectBody, body: bytes) -> bool:
        if id(self) not in narrowed:  # a slow network: a small send buffer, no autotuning
            narrowed.add(id(self))
            sock = self._transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        full = self._open and self._cycle.flow.write_paused
        ok = real(self, body)
        direct["written"] += ok
        direct["refused_full"] += full
        return ok

    monkeypatch.setattr(DirectBody, "write", counted)
    engines = {n: FakeEngine(n_ctx=4096, token_delay_s=0.0005) for n in ("f16", "q8_0", "q4_k_m")}
    rng = random.Random(seed)
    kinds = tuple(k for k in KINDS if k != "drop" or window > 64)
    stats = dict.fromkeys(kinds, 0) | {"resumed": 0 if "drop" in kinds else 1}
    # a keep-alive connection outlives a slow reader's last chunks (uvicorn's default: 5 s
    # after the server wrote them), so its next request finds it open
    async with live(chaos_app(engines, window), timeout_keep_alive=60) as port:
        async with asyncio.timeout(120), asyncio.TaskGroup() as clients:  # one fails: all stop
            for _ in range(40):
                clients.create_task(play(port, random.Random(rng.random()), kinds, stats))
        # every generation ends: a client that left cancelled its own, nobody waits on grace
        for _ in range(300):
            if all(e.in_flight == 0 for e in engines.values()):
                break
            await asyncio.sleep(0.01)
        assert [e.in_flight for e in engines.values()] == [0, 0, 0]
    assert min(stats.values()) > 0, stats  # every way of reading was played
    # both paths carried events: written where they were made, and (where the window lets
    # a slow reader's socket fill before its producer waits) through send past a full one
    assert direct["written"] > 100 and (direct["refused_full"] > 0 or window < 100), direct

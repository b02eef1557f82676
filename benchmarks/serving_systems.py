"""The systems the serving benchmark compares, each behind one small interface.

* ``quantroute`` -- ``quantroute serve --repo DIR``, pinned to ``model:branch``;
* ``llama-server`` -- llama.cpp's own server (``scripts/llama_server_build.sh`` builds it from
  the llama.cpp revision llama-cpp-python vendors), ``--parallel N``, continuous batching;
* ``llama-cpp-python`` -- ``python -m llama_cpp.server``, with ``interrupt_requests`` on (its
  default: a new request cuts the running stream) and off (it queues);
* ``bare-gateway`` -- ``benchmarks/bare_gateway.py``: uvicorn and one raw ASGI function in
  front of quantroute's worker, driving it as the gateway does, with nothing else: the floor
  of a Python gateway process over that worker;
* ``ceiling`` -- quantroute's own worker (``python -m quantroute.engines.llamacpp_worker``)
  driven over its stdin/stdout protocol from this process: no gateway, no HTTP. quantroute
  serving over HTTP does all of this plus the gateway, so it cannot beat it.

Each system streams completions as a list of :class:`Stream` records, the same way: the time
the request was sent, the arrival of every text chunk, the usage the system reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lean_http import Connection, ConnectionClosed
from servers import Server, free_port, quantroute_command, tree_cpu_s

QUANTROUTE, LLAMA_SERVER, LCP, LCP_QUEUE, CEILING, BARE = (
    "quantroute", "llama-server", "llama-cpp-python", "llama-cpp-python-queue", "ceiling",
    "bare-gateway",
)  # fmt: skip
LABELS = {
    QUANTROUTE: "quantroute",
    LLAMA_SERVER: "llama-server",
    LCP: "llama-cpp-python server",
    LCP_QUEUE: "llama-cpp-python server, interrupt_requests=False",
    CEILING: "ceiling: quantroute's worker, no gateway",
    BARE: "bare gateway: uvicorn and quantroute's worker, nothing else",
}
ALL_SYSTEMS = (QUANTROUTE, LLAMA_SERVER, LCP_QUEUE, LCP, CEILING, BARE)
GATEWAYS = (QUANTROUTE, BARE)  # a Python process in front of llama.cpp worker processes
BAN = -100.0  # the logit bias that keeps a token from ever being chosen


@dataclass(slots=True)
class Stream:
    """One streamed completion as its client saw it; times are perf_counter seconds."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per chunk carrying text
    usage_tokens: int | None = None  # completion_tokens, where the system reports it
    finish_reason: str | None = None
    error: str | None = None
    text: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return len(self.arrivals)

    @property
    def tokens(self) -> int:
        """The one counting rule: the usage the system reports, else its text chunks."""
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token latency: the gaps between consecutive text chunks."""
        return [b - a for a, b in itertools.pairwise(self.arrivals)]

    @property
    def cut(self) -> bool:
        """Ended without a finish_reason: the server closed it early."""
        return self.finish_reason is None

    def count_error(self, max_tokens: int) -> str | None:
        """Why this stream's token count cannot be trusted, or None.

        Usage is checked against the chunks: a chunk carries at least one token, so there
        are never more chunks than tokens; and with end-of-sequence banned, a stream that
        ends normally has exactly ``max_tokens`` tokens, counted either way."""
        if self.error is not None or self.cut:
            return None
        if self.chunks > self.tokens:
            return f"{self.chunks} text chunks but usage says {self.tokens} tokens"
        if self.tokens != max_tokens:
            return f"{self.tokens} tokens, not max_tokens {max_tokens}"
        return None

    def fold_chunk(self, chunk: dict[str, Any], now: float) -> None:
        """Fold one completion chunk (OpenAI's shape) into the record."""
        if chunk.get("usage"):
            self.usage_tokens = int(chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices") or ():
            if choice.get("text"):
                self.arrivals.append(now)
                self.text.append(choice["text"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


@dataclass(frozen=True, slots=True)
class Workload:
    """What every system is asked for: the same prompt and greedy sampling."""

    model_id: str
    prompt: str
    max_tokens: int
    eos_id: int
    prompt_cache: bool


class System(Protocol):
    name: str
    retries: int

    def start(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...
    def cpu_s(self) -> float: ...
    def gateway_cpu_s(self) -> float | None: ...
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def stream(self, work: Workload) -> Stream: ...


# -- over HTTP ------------------------------------------------------------------


class HttpSystem:
    """A server subprocess streaming ``/v1/completions`` over loopback HTTP."""

    def __init__(self, server: Server, extra_body: dict[str, Any], max_clients: int):
        self.name = server.name
        self.server = server
        self.extra_body = extra_body
        self.max_clients = max_clients
        self.idle: list[Connection] = []  # kept-alive connections no stream is using
        self.retries = 0

    def start(self, timeout_s: float) -> None:
        self.server.start()
        try:
            self.server.wait_ready(timeout_s)
        except BaseException:
            self.server.stop()
            raise

    def stop(self) -> None:
        self.server.stop()

    def cpu_s(self) -> float:
        return self.server.cpu_s()

    def gateway_cpu_s(self) -> float | None:
        """A Python gateway's own process (quantroute's, the bare one's) apart from its
        llama.cpp worker; ``None`` for a server that is one process with its engine."""
        return self.server.own_cpu_s() if self.name in GATEWAYS else None

    async def open(self) -> None:
        self.idle = []

    async def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle = []

    def body(self, work: Workload) -> dict[str, Any]:
        return {
            "model": work.model_id,
            "prompt": work.prompt,
            "max_tokens": work.max_tokens,
            "temperature": 0.0,
            "logit_bias": {str(work.eos_id): BAN},
            "stream": True,
            "stream_options": {"include_usage": True},
        } | self.extra_body

    async def stream(self, work: Workload) -> Stream:
        """One streamed completion. A request sent on a kept-alive connection the server had
        just closed (cpp-httplib and uvicorn close idle ones) gets no response at all: it is
        sent again once, on a new connection, timed from the new send, as any HTTP client
        retries it; ``retries`` counts."""
        conn = self.idle.pop() if self.idle else Connection("127.0.0.1", self.server.port)
        try:
            record, stale = await self._stream_once(conn, work)
            if stale:
                self.retries += 1
                conn = Connection("127.0.0.1", self.server.port)
                record, _ = await self._stream_once(conn, work)
        except BaseException:
            conn.close()
            raise
        if conn.writer is not None and len(self.idle) < self.max_clients + 2:
            self.idle.append(conn)
        else:
            conn.close()
        return record

    async def _stream_once(self, conn: Connection, work: Workload) -> tuple[Stream, bool]:
        """One request on ``conn``, and whether the connection turned out stale (closed by
        the server before any response)."""
        body = json.dumps(self.body(work)).encode()
        record = Stream(sent=time.perf_counter())
        try:
            resp = await conn.post("/v1/completions", body)
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return record, False
            async for line in resp.lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                record.fold_chunk(json.loads(line[6:]), time.perf_counter())
        except ConnectionClosed:
            return record, True
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:  # JSON errors too
            conn.close()
            record.error = f"{type(exc).__name__}: {exc}"
        return record, False


def quantroute_system(
    repo: Path, cfg: Settings, logs: Path, *, name: str = QUANTROUTE, src: Path | None = None
) -> HttpSystem:
    """``quantroute serve``; with ``src``, the code in that folder (``PYTHONPATH``: a git
    worktree's ``src``, say) on this interpreter, its workers too."""
    port = free_port()
    command = [quantroute_command()] if src is None else [
        "env", f"PYTHONPATH={src.resolve()}", sys.executable, "-m", "quantroute.cli",
    ]  # fmt: skip
    argv = [
        *command, "serve", "--repo", str(repo), "--host", "127.0.0.1",
        "--port", str(port), "--engine-parallel", str(cfg.parallel),
        "--engine-n-threads", str(cfg.threads), "--engine-n-ctx", str(cfg.n_ctx),
        "--server-log-level", "warning",
        "--engine-prompt-cache", "true" if cfg.prompt_cache else "false",
    ]  # fmt: skip
    server = Server(name, argv, port, "/readyz", logs / f"{name}.log")
    return HttpSystem(server, {}, cfg.parallel)


def llama_server_system(binary: Path, model: Path, cfg: Settings, logs: Path) -> HttpSystem:
    """llama.cpp's server: N slots of n_ctx each, continuous batching, the same threads.

    Prompt caching off (to match quantroute): ``cache_prompt: false`` on every request,
    ``--no-cache-prompt``, ``--cache-reuse 0`` and no host-memory prompt cache
    (``--cache-ram 0``)."""
    port = free_port()
    argv = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(cfg.threads), "-tb", str(cfg.threads), "--parallel", str(cfg.parallel),
        "-c", str(cfg.n_ctx * cfg.parallel), "--no-kv-unified", "--cont-batching",
        "-b", "512", "-ub", "512", "-ngl", str(cfg.n_gpu_layers), "--no-webui",
        "--cache-reuse", "256" if cfg.prompt_cache else "0",
        *(() if cfg.prompt_cache else ("--no-cache-prompt", "--cache-ram", "0")),
    ]  # fmt: skip
    server = Server(LLAMA_SERVER, argv, port, "/health", logs / "llama-server.log")
    return HttpSystem(server, {"cache_prompt": cfg.prompt_cache}, cfg.parallel)


def lcp_system(
    model: Path, model_id: str, cfg: Settings, logs: Path, interrupt: bool
) -> HttpSystem:
    """llama-cpp-python's server: one request at a time; ``interrupt`` cuts running streams."""
    port = free_port()
    name = LCP if interrupt else LCP_QUEUE
    argv = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model),
        "--model_alias", model_id, "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(cfg.n_ctx), "--n_threads", str(cfg.threads),
        "--n_threads_batch", str(cfg.threads), "--verbose", "False",
        "--interrupt_requests", str(interrupt), "--flash_attn", "True",
        "--n_gpu_layers", str(cfg.n_gpu_layers),
    ]  # fmt: skip
    server = Server(name, argv, port, "/v1/models", logs / f"{name}.log")
    # Its repeat_penalty defaults to 1.1; the others have none.
    return HttpSystem(server, {"repeat_penalty": 1.0}, cfg.parallel)


def bare_gateway_system(model: Path, cfg: Settings, logs: Path) -> HttpSystem:
    port = free_port()
    argv = [
        sys.executable, str(Path(__file__).with_name("bare_gateway.py")), "--model", str(model),
        "--port", str(port), "--n-ctx", str(cfg.n_ctx), "--parallel", str(cfg.parallel),
        "--threads", str(cfg.threads), "--n-gpu-layers", str(cfg.n_gpu_layers),
        "--logs", str(logs), *(("--prompt-cache",) if cfg.prompt_cache else ()),
    ]  # fmt: skip
    server = Server(BARE, argv, port, "/health", logs / "bare-gateway.log")
    return HttpSystem(server, {}, cfg.parallel)


# -- the ceiling: the worker, driven directly ------------------------------------


class WorkerCeiling:
    """quantroute's llama.cpp worker process, fed ``gen`` commands on stdin by this process
    and read on stdout: the decode loop the gateway drives, with nothing in between."""

    name = CEILING

    def __init__(
        self, model: Path, cfg: Settings, logs: Path, log_name: str = "ceiling-worker.log"
    ):
        self.argv = [
            sys.executable, "-m", "quantroute.engines.llamacpp.worker", "--model", str(model),
            "--n-ctx", str(cfg.n_ctx), "--parallel", str(cfg.parallel),
            "--n-threads", str(cfg.threads), "--log-level", "warning",
            "--n-gpu-layers", str(cfg.n_gpu_layers),
            *(() if cfg.prompt_cache else ("--no-prompt-cache",)),
        ]  # fmt: skip
        self.log_path = logs / log_name
        self.proc: asyncio.subprocess.Process | None = None
        self.waiters: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.ids = itertools.count()
        self.reader: asyncio.Task[None] | None = None
        self.retries = 0  # never: no connections to go stale

    def start(self, timeout_s: float) -> None:  # the process starts in open(), on the loop
        self.timeout_s = timeout_s

    def stop(self) -> None:
        pass  # close() ends it

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def gateway_cpu_s(self) -> float | None:
        return None  # no gateway: the benchmark drives the worker

    async def open(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                limit=1 << 24,
            )  # fmt: skip
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), self.timeout_s)
        if not line or json.loads(line).get("ev") != "ready":
            raise RuntimeError(f"the ceiling's worker did not start; see {self.log_path}")
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            event, at = json.loads(line), time.perf_counter()
            if event.get("ev") == "toks":  # one step's tokens: [id, text, token] triples
                for rid, text, _ in event["b"]:
                    waiter = self.waiters.get(rid)
                    if waiter is not None:
                        waiter.put_nowait({"ev": "tok", "t": text, "_at": at})
                continue
            waiter = self.waiters.get(event.get("id", ""))
            if waiter is not None:
                waiter.put_nowait(event | {"_at": at})

    async def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, BrokenPipeError, ConnectionResetError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(b'{"op":"shutdown"}\n')
            await self.proc.stdin.drain()
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader

    async def events(
        self, prompt: str, max_tokens: int, logit_bias: list[tuple[int, float]]
    ) -> AsyncIterator[dict[str, Any]]:
        """One greedy ``gen`` on the worker: its events as they are read (plain tokens as
        ``{"ev": "tok", "t": text}``), each with ``_at``, its arrival, until ``fin`` or
        ``err``."""
        assert self.proc is not None and self.proc.stdin is not None
        rid = f"c{next(self.ids)}"
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.waiters[rid] = events
        command = {
            "op": "gen", "id": rid, "prompt": prompt, "special": False,
            "s": {
                "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                "seed": None, "stop": [], "logprobs": False, "top_logprobs": 0,
                "logit_bias": [list(pair) for pair in logit_bias],
            },
        }  # fmt: skip
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        await self.proc.stdin.drain()
        try:
            while True:
                event = await events.get()
                yield event
                if event.get("ev") in ("fin", "err"):
                    return
        finally:
            del self.waiters[rid]

    async def stream(self, work: Workload) -> Stream:
        record = Stream(sent=time.perf_counter())
        async for event in self.events(work.prompt, work.max_tokens, [(work.eos_id, BAN)]):
            kind = event.get("ev")
            if kind == "tok" and event.get("t"):
                record.arrivals.append(event["_at"])
                record.text.append(event["t"])
            elif kind == "fin":
                if event.get("t"):
                    record.arrivals.append(event["_at"])
                    record.text.append(event["t"])
                record.usage_tokens = int(event["ct"])
                record.finish_reason = event["reason"]
            elif kind == "err":
                record.error = f"{event.get('code')}: {event.get('msg')}"
        return record


@dataclass(frozen=True, slots=True)
class Settings:
    """What all systems share: llama.cpp threads, slots, context per sequence, caching."""

    threads: int
    parallel: int
    n_ctx: int
    prompt_cache: bool
    n_gpu_layers: int = 0

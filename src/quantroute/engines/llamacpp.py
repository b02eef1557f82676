"""``LlamaCppEngine``: a branch served by a supervised llama.cpp worker process.

The gateway side of the worker protocol (see ``llamacpp_worker``): one
reader task fans the worker's events out to per-request queues; a dead
worker fails every in-flight request with ``EngineCrashedError`` and the
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from quantroute.engines.base import (
    EngineEvent,
    EngineInfo,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor
from quantroute.errors import (
    ContextLengthExceededError,
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
)

log = logging.getLogger(__name__)

_Item = dict[str, Any] | BaseException


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    n_ctx: int = 0
    parallel: int = 4
    n_threads: int = 0
    n_batch: int = 512
    n_gpu_layers: int = 0
    log_level: str = "info"
    start_timeout_s: float = 120.0
    cpus: tuple[int, ...] = ()  # pin the worker to these cores; () leaves it unpinned


class WorkerListener(Protocol):
    """Told when a branch's worker process becomes ready or dies (placement and
    memory accounting live outside the engine)."""

    def worker_ready(self, engine: LlamaCppEngine, pid: int) -> None: ...

    def worker_exited(self, engine: LlamaCppEngine, returncode: int) -> None: ...


class LlamaCppEngine:
    """Runs one GGUF file in a worker process; see :class:`quantroute.engines.Engine`."""

    def __init__(
        self,
        name: str,
        model_path: Path,
        options: WorkerOptions,
        policy: RestartPolicy,
        *,
        listener: WorkerListener | None = None,
    ):
        self.name = name
        self.listener = listener
        self.model_path = model_path
        self._options = options
        self._info: EngineInfo | None = None
        self._ready = False
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        argv = [
            sys.executable,
            "-m",
            "quantroute.engines.llamacpp_worker",
            "--model",
            str(model_path),
        ]
        for key, value in asdict(options).items():
            if key == "cpus":
                if value:
                    argv += ["--cpus", ",".join(map(str, value))]
            elif key != "start_timeout_s":
                argv += [f"--{key.replace('_', '-')}", str(value)]
        self._supervisor = WorkerSupervisor(
            name, argv, on_start=self._on_start, on_exit=self._on_exit, policy=policy
        )

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def info(self) -> EngineInfo | None:
        return self._info

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def restarts(self) -> int:
        return self._supervisor.restarts

    @property
    def pid(self) -> int | None:
        proc = self._supervisor.process
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self) -> None:
        """Start the worker; a worker that fails is logged and retried, never raised."""
        try:
            await self._supervisor.start()
        except Exception as exc:
            log.error("%s: not ready: %s (the supervisor keeps retrying)", self.name, exc)

    async def stop(self) -> None:
        self._ready = False
        await self._supervisor.stop()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail_all(EngineUnavailableError(f"branch {self.name} is shutting down"))

    # -- worker lifecycle -----------------------------------------------------

    async def _on_start(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), self._options.start_timeout_s)
        if not line:
            raise EngineError(f"{self.name}: worker exited while loading {self.model_path.name}")
        hello = json.loads(line)
        if hello.get("ev") != "ready":
            raise EngineError(f"{self.name}: worker sent {hello.get('ev')!r} before 'ready'")
        self._info = EngineInfo(**hello["info"])
        self._reader = asyncio.create_task(self._read(proc), name=f"read:{self.name}")
        self._ready = True
        if self.listener is not None:
            self.listener.worker_ready(self, proc.pid)
        log.info(
            "%s: worker %s ready (n_ctx=%d, parallel=%d)",
            self.name,
            proc.pid,
            self._info.n_ctx,
            self._info.parallel,
        )

    def _on_exit(self, returncode: int) -> None:
        self._ready = False
        log.error(
            "%s: worker died (exit %s) with %d requests in flight",
            self.name,
            returncode,
            len(self._streams),
        )
        self._fail_all(
            EngineCrashedError(
                f"the worker serving {self.name} stopped unexpectedly (exit {returncode})"
            )
        )
        if self.listener is not None:
            self.listener.worker_exited(self, returncode)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.error("%s: unreadable line from the worker dropped", self.name)
                continue
            stream = self._streams.get(event.get("id", ""))
            if stream is not None:
                stream.put_nowait(event)

    def _send(self, command: dict[str, Any]) -> None:
        proc = self._supervisor.process
        if proc is None or proc.stdin is None or proc.returncode is not None or not self._ready:
            raise EngineUnavailableError(f"branch {self.name} is not ready")
        proc.stdin.write(json.dumps(command, separators=(",", ":")).encode() + b"\n")

    async def _exchange(
        self, command: dict[str, Any], last: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Send ``command``; yield the worker's events for it up to the one named ``last``.
        An ``err`` event or a dead worker raises; leaving early cancels the command."""
        rid = command["id"]
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[rid] = stream
        done = False
        try:
            self._send(command)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item["ev"] == "err":
                    done = True
                    raise _worker_error(self.name, item)
                done = item["ev"] == last
                yield item
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done:
                with contextlib.suppress(EngineError):
                    self._send({"op": "cancel", "id": rid})

    # -- scoring --------------------------------------------------------------

    async def score(
        self, prompt: str, tokens: list[int], *, parse_special: bool = False
    ) -> npt.NDArray[np.float32]:
        """Teacher-force ``tokens`` after ``prompt``; return the log-softmax rows
        that predicted each of them, ``[len(tokens), n_vocab]``."""
        command = {
            "op": "score",
            "id": f"score.{next(self._ids)}",
            "prompt": prompt,
            "special": parse_special,
            "tokens": tokens,
        }
        async with contextlib.aclosing(self._exchange(command, last="rows")) as events:
            async for item in events:
                if item["ev"] == "rows":
                    data = base64.b64decode(item["data"])
                    return np.frombuffer(data, dtype=np.float32).reshape(item["shape"])
        raise EngineError(f"branch {self.name}: scoring ended without rows")

    # -- generation -----------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        s = request.sampling
        command = {
            "op": "gen",
            "id": f"{request.request_id}.{next(self._ids)}",
            "prompt": request.prompt,
            "special": request.parse_special,
            "s": {
                "max_tokens": s.max_tokens,
                "fit_context": s.fit_context,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "seed": s.seed,
                "stop": list(s.stop),
                "logprobs": s.logprobs,
                "top_logprobs": s.top_logprobs,
                "logit_bias": [list(pair) for pair in s.logit_bias],
                "ignore_eos": s.ignore_eos,
            },
        }
        async with contextlib.aclosing(self._exchange(command, last="fin")) as events:
            async for item in events:
                kind = item["ev"]
                if kind == "tok":
                    top = tuple((t, text, lp) for t, text, lp in item.get("top", ()))
                    yield TokenEvent(item["t"], item["tok"], item.get("lp"), item.get("p"), top)
                elif kind == "start":
                    yield StartEvent(item["pt"])
                elif kind == "fin":
                    yield FinishEvent(
                        FinishReason(item["reason"]), item["pt"], item["ct"], item["t"]
                    )


def _worker_error(branch: str, event: dict[str, Any]) -> Exception:
    if event.get("code") == "context_length_exceeded":
        return ContextLengthExceededError(
            prompt_tokens=event["pt"], max_tokens=event["max_tokens"], n_ctx=event["n_ctx"]
        )
    return EngineError(f"branch {branch}: {event.get('msg', 'generation failed')}")

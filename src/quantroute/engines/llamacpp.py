"""``LlamaCppEngine``: a branch served by a supervised llama.cpp worker process.

The gateway side of the worker protocol (see ``llamacpp_worker``): one
reader task fans the worker's events out to per-request queues; a dead
worker fails every in-flight request with ``EngineCrashedError`` and the
supervisor restarts it. A new worker is warmed up (one batch of prompt, one
token) before it is ready, so the first decode — where a CPU that lacks an
instruction of the build dies — happens before any request is routed to it;
a worker that keeps failing marks the branch failed (``failure``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from quantroute.engines.base import (
    EngineEvent,
    EngineInfo,
    EngineListener,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StartEvent,
    TokenEvent,
)
from quantroute.engines.exits import describe_exit
from quantroute.engines.supervisor import RestartPolicy, WorkerSupervisor
from quantroute.errors import (
    ContextLengthExceededError,
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
)
from quantroute.types import Offload

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
    fault: str = ""  # fault injection for tests (see llamacpp_worker --fault)
    gpu: int | None = None  # CUDA device index (NVML order); None: the CPU

    def argv(self, model_path: Path) -> list[str]:
        argv = [sys.executable, "-m", "quantroute.engines.llamacpp_worker"]
        argv += ["--model", str(model_path)]
        for key, value in asdict(self).items():
            if key == "cpus":
                if value:
                    argv += ["--cpus", ",".join(map(str, value))]
            elif key == "fault":
                if value:
                    argv += ["--fault", value]
            elif key not in ("start_timeout_s", "gpu"):
                argv += [f"--{key.replace('_', '-')}", str(value)]
        return argv

    def env(self) -> dict[str, str]:
        """The worker's environment: the gateway's, with the GPU it may see (NVML's order,
        so ``cuda:N`` is the same device for both), or none on the CPU."""
        env = dict(os.environ)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = "" if self.gpu is None else str(self.gpu)
        return env


class LlamaCppEngine:
    """Runs one GGUF file in a worker process; see :class:`quantroute.engines.Engine`."""

    def __init__(
        self,
        name: str,
        model_path: Path,
        options: WorkerOptions,
        policy: RestartPolicy,
        *,
        listener: EngineListener | None = None,
    ):
        self.name = name
        self._listener = listener
        self._model_path = model_path
        self._options = options
        self._info: EngineInfo | None = None
        self._ready = False
        self._accepting = False  # the worker takes commands (the warm-up's, then everyone's)
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._supervisor = WorkerSupervisor(
            name,
            options.argv(model_path),
            on_start=self._on_start,
            on_exit=self._on_exit,
            on_failed=self._on_failed,
            policy=policy,
            env=options.env(),
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

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def failure(self) -> str | None:
        return self._supervisor.failure

    @property
    def can_score(self) -> bool:
        return True

    @property
    def options(self) -> WorkerOptions:
        return self._options

    def listen(self, listener: EngineListener) -> None:
        self._listener = listener

    def offload(self, offload: Offload) -> None:
        layers = offload.n_gpu_layers if offload.gpu is not None else 0
        self._options = replace(self._options, gpu=offload.gpu, n_gpu_layers=layers)
        self._supervisor.argv = self._options.argv(self._model_path)
        self._supervisor.env = self._options.env()

    async def start(self) -> None:
        """Start the worker; a worker that fails is logged and retried, never raised."""
        try:
            await self._supervisor.start()
        except Exception as exc:
            log.error("%s: not ready: %s", self.name, exc)

    async def restart(self) -> None:
        """Clear a failure and start a fresh worker; like ``start``, never raises for it."""
        self._ready = False
        try:
            await self._supervisor.restart()
        except Exception as exc:
            log.error("%s: not ready after restart: %s", self.name, exc)

    async def stop(self) -> None:
        self._ready = False
        self._accepting = False
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
        self._accepting = True
        await self._warm_up(self._info)
        self._supervisor.note_healthy()
        self._ready = True
        if self._listener is not None:
            self._listener.engine_ready(self)
        log.info(
            "%s: worker %s ready (n_ctx=%d, parallel=%d)",
            self.name,
            proc.pid,
            self._info.n_ctx,
            self._info.parallel,
        )

    async def _warm_up(self, info: EngineInfo) -> None:
        """One batch of prompt and one token: the first decode, and the allocations that
        come with it, happen here rather than in someone's request."""
        prompt = "x" * max(1, min(info.n_ctx - 2, self._options.n_batch - 1))
        warmup = GenerationRequest("warmup", prompt, SamplingParams(max_tokens=1, temperature=0))
        try:
            async for _ in self.generate(warmup):
                pass
        except EngineError as exc:
            raise EngineError(f"{self.name}: warm-up failed: {exc.message}") from exc

    def _on_exit(self, returncode: int) -> None:
        self._ready = False
        self._accepting = False
        cause = describe_exit(returncode)
        log.error(
            "%s: worker died (%s) with %d requests in flight",
            self.name,
            cause,
            len(self._streams),
        )
        self._fail_all(
            EngineCrashedError(f"the worker serving {self.name} stopped unexpectedly: {cause}")
        )
        if self._listener is not None:
            self._listener.engine_exited(self, returncode)

    def _on_failed(self, cause: str) -> None:
        self._ready = False
        if self._listener is not None:
            self._listener.engine_failed(self, cause)

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
        # The worker closed its stdout: it is dying. Fail what waits on it now (a warm-up
        # included), rather than when the supervisor notices the exit.
        self._accepting = False
        try:
            code = await asyncio.wait_for(proc.wait(), 5.0)
            cause = describe_exit(code)
        except TimeoutError:
            cause = "it closed its output"
        self._fail_all(
            EngineCrashedError(f"the worker serving {self.name} stopped unexpectedly: {cause}")
        )

    def _send(self, command: dict[str, Any]) -> None:
        proc = self._supervisor.process
        if proc is None or proc.stdin is None or proc.returncode is not None or not self._accepting:
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
                    self._supervisor.note_healthy()  # a finished generation: a healthy run
                    yield FinishEvent(
                        FinishReason(item["reason"]), item["pt"], item["ct"], item["t"]
                    )


def _worker_error(branch: str, event: dict[str, Any]) -> Exception:
    if event.get("code") == "context_length_exceeded":
        return ContextLengthExceededError(
            prompt_tokens=event["pt"], max_tokens=event["max_tokens"], n_ctx=event["n_ctx"]
        )
    return EngineError(f"branch {branch}: {event.get('msg', 'generation failed')}")

"""``LlamaCppEngine``: a branch served by a supervised llama.cpp worker process.

The gateway side of the worker protocol (see ``llamacpp_worker``): one
reader task fans the worker's events out to per-request queues; a dead
worker fails every in-flight request with ``EngineCrashedError`` and the
supervisor restarts it. A new worker is warmed up (one batch of prompt, one
token) before it is ready, so the first decode — where a CPU that lacks an
instruction of the build dies — happens before any request is routed to it;
a worker that keeps failing marks the branch failed (``failure``).

Nothing waits on the worker forever. The reader task is supervised: if it
fails (a line over the pipe's limit, output that is not the protocol), the
worker is *abandoned* — every in-flight request gets ``EngineCrashedError``,
the process is killed and the supervisor restarts it. Every exchange has a
timeout (``WorkerOptions.gen_idle_timeout_s`` between a generation's events,
``score_timeout_s`` for a whole scoring command); a request that runs out
gets ``EngineError`` (code ``engine_timeout``), and if the worker has sent
nothing at all for that long it is abandoned too. Commands are written with
``drain()``, within the same timeouts.

A worker loads only the bytes that were verified (``registry.verified``):
before each spawn the engine opens its file and checks the descriptor
against the verification (a file that changed is refused: the branch fails
in words), the worker loads that descriptor (``/proc/self/fd/N``), and the
engine keeps it open while the worker lives, to find a rewrite in place
(:meth:`LlamaCppEngine.file_moved`). The worker's environment is built from
an allowlist (:func:`worker_env`): no key or token of the gateway's reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from quantroute.engines.base import (
    EngineEvent,
    EngineInfo,
    EngineListener,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    PromptCacheStats,
    ReferenceLogits,
    SamplingParams,
    StartEvent,
    TokenEvent,
    TokenScores,
)
from quantroute.engines.environment import worker_env
from quantroute.engines.exits import describe_exit
from quantroute.engines.inbox import Inbox
from quantroute.engines.llamacpp.exchange_timer import ExchangeTimer
from quantroute.engines.supervisor import Launch, RestartPolicy, WorkerSupervisor
from quantroute.errors import (
    ArtifactIntegrityError,
    ContextLengthExceededError,
    DeviceOutOfMemoryError,
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
)
from quantroute.registry.verified import VerifiedFile
from quantroute.types import Offload

log = logging.getLogger(__name__)

_Item = dict[str, Any] | TokenEvent | BaseException

PIPE_LINE_LIMIT_BYTES = 1 << 24
"""The longest line the gateway reads from a worker (``engines/supervisor.py`` opens the
pipe with this ``limit``); a longer one kills the reader, and the worker is restarted."""
# A request's events waiting for its reader: at the high mark the worker pauses its
# sequence (it keeps its slot, decodes nothing); at the low mark it resumes. A slow
# reader so costs the gateway at most this many events, never an unbounded buffer.
STREAM_HIGH_WATER = 64
STREAM_LOW_WATER = 16
EXIT_GRACE_S = 5.0
"""How long a worker that closed its output may take to exit before it is killed."""


def _close_opened(opening: asyncio.Future[tuple[int, VerifiedFile]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        with contextlib.suppress(OSError):
            os.close(opening.result()[0])


# Read by the gateway only; not passed to the worker.
_GATEWAY_ONLY = frozenset({"start_timeout_s", "gen_idle_timeout_s", "score_timeout_s", "gpu"})


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    n_ctx: int = 0
    parallel: int = 4
    n_threads: int = 0
    n_batch: int = 512
    n_gpu_layers: int = 0
    log_level: str = "info"
    start_timeout_s: float = 120.0
    # A generation's longest wait for its next event (a request queued behind long ones
    # waits for a free sequence, so this is generous).
    gen_idle_timeout_s: float = 300.0
    score_timeout_s: float = 300.0  # a whole scoring command (logits or score)
    # The worker's longest event line; a longer event is an error for its request only.
    max_event_bytes: int = 1 << 20
    cpus: tuple[int, ...] = ()  # pin the worker to these cores; () leaves it unpinned
    fault: str = ""  # fault injection for tests (see llamacpp_worker --fault)
    gpu: int | None = None  # CUDA device index (NVML order); None: the CPU
    oom_flag: str = ""  # a simulated device's out-of-memory flag file (see Offload)
    prompt_cache: bool = True  # reuse finished sequences' KV prefixes (prompt_cache.py)
    sampler: str = "chain"  # llama.cpp's sampler chain; "numpy" (sampling.py) is a reference

    def __post_init__(self) -> None:
        if not 1024 <= self.max_event_bytes <= PIPE_LINE_LIMIT_BYTES // 2:
            raise ValueError(
                f"max_event_bytes must lie in [1024, {PIPE_LINE_LIMIT_BYTES // 2}] (half the "
                f"pipe's line limit), not {self.max_event_bytes}"
            )
        if self.gen_idle_timeout_s <= 0 or self.score_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    def argv(self, model_path: Path) -> list[str]:
        argv = [sys.executable, "-m", "quantroute.engines.llamacpp.worker"]
        argv += ["--model", str(model_path)]
        for key, value in asdict(self).items():
            if key == "cpus":
                if value:
                    argv += ["--cpus", ",".join(map(str, value))]
            elif key in ("fault", "oom_flag"):
                if value:
                    argv += [f"--{key.replace('_', '-')}", value]
            elif key == "prompt_cache":
                if not value:
                    argv.append("--no-prompt-cache")
            elif key == "sampler":
                if value != "chain":
                    argv += ["--sampler", value]
            elif key not in _GATEWAY_ONLY:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        return argv

    def env(self) -> dict[str, str]:
        """The worker's environment: the gateway's allowlisted part (:func:`worker_env`),
        with the GPU it may see (NVML's order, so ``cuda:N`` is the same device for
        both), or none on the CPU."""
        env = worker_env(os.environ)
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
        verified: VerifiedFile | None = None,
    ):
        self.name = name
        self._listener = listener
        self._model_path = model_path
        # the file as verified (None: a file nothing verified, tests' own; loaded by path)
        self._verified = verified
        self._model_fd: int | None = None  # the open file the current worker loaded
        self._options = options
        self._info: EngineInfo | None = None
        self._ready = False
        self._accepting = False  # the worker takes commands (the warm-up's, then everyone's)
        self._streams: dict[str, Inbox[_Item]] = {}
        self._paused: set[str] = set()  # requests the worker holds for their slow readers
        self._held: set[str] = set()  # requests it held at some point (FinishEvent.held)
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._last_line_at = time.monotonic()  # when the worker last sent anything
        # commands the worker owes an answer (their last event), by when they were sent:
        # those in flight, and those their callers left (a cancel sent) until its "fin"
        self._owed: dict[str, float] = {}
        self._abandoned: str | None = None  # why we killed the current worker, if we did
        self._cache_stats = PromptCacheStats(enabled=options.prompt_cache)
        self._supervisor = WorkerSupervisor(
            name,
            options.argv(model_path),
            on_start=self._on_start,
            on_exit=self._on_exit,
            on_failed=self._on_failed,
            policy=policy,
            env=options.env(),
            prepare=self._prepare if verified is not None else None,
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
    def prompt_cache(self) -> PromptCacheStats:
        return self._cache_stats

    @property
    def options(self) -> WorkerOptions:
        return self._options

    def listen(self, listener: EngineListener) -> None:
        self._listener = listener

    def offload(self, offload: Offload) -> None:
        layers = offload.n_gpu_layers if offload.gpu is not None else 0
        self._options = replace(
            self._options, gpu=offload.gpu, n_gpu_layers=layers, oom_flag=offload.oom_flag
        )
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
        self._release_file()
        self._fail_all(EngineUnavailableError(f"branch {self.name} is shutting down"))

    def file_moved(self) -> str | None:
        """Why the file the running worker loaded is no longer the verified one (it was
        rewritten in place), in words; ``None`` while it holds or no worker runs. A
        reload asks every engine; a branch whose file moved is killed, and its restart
        refuses the file (:meth:`_prepare`)."""
        fd, verified = self._model_fd, self._verified
        if fd is None or verified is None:
            return None
        return verified.moved(fd)

    def refuse(self, cause: str) -> None:
        """Kill the running worker because its file is no longer the verified one; the
        supervisor restarts it only through :meth:`_prepare`'s check."""
        log.error("%s: %s", self.name, cause)
        self._supervisor.kill(cause)

    # -- worker lifecycle -----------------------------------------------------

    async def _prepare(self) -> Launch:
        """Before each spawn: open the file and prove it holds the verified bytes (in a
        thread: it may read the whole file); the worker loads that descriptor."""
        assert self._verified is not None
        self._release_file()
        opening = asyncio.ensure_future(asyncio.to_thread(self._verified.open))
        try:
            fd, self._verified = await asyncio.shield(opening)
        except asyncio.CancelledError:  # a stop during the check: close what it opens
            opening.add_done_callback(_close_opened)
            raise
        self._model_fd = fd
        argv = self._options.argv(Path(f"/proc/self/fd/{fd}"))
        return Launch(tuple(argv), (fd,))

    def _release_file(self) -> None:
        fd, self._model_fd = self._model_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _check_loaded(self) -> None:
        """The file did not change while the worker loaded it (see ``registry.verified``)."""
        moved = self.file_moved()
        if moved is not None:
            raise ArtifactIntegrityError(moved)

    async def _on_start(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        self._abandoned = None
        line = await asyncio.wait_for(proc.stdout.readline(), self._options.start_timeout_s)
        if not line:
            raise EngineError(f"{self.name}: worker exited while loading {self.model_path.name}")
        hello = json.loads(line)
        if hello.get("ev") != "ready":
            raise EngineError(f"{self.name}: worker sent {hello.get('ev')!r} before 'ready'")
        self._check_loaded()
        self._info = EngineInfo(**hello["info"])
        self._last_line_at = time.monotonic()
        self._owed.clear()
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
        warmup = GenerationRequest(_WARMUP, prompt, SamplingParams(max_tokens=1, temperature=0))
        try:
            async for _ in self.generate(warmup):
                pass
        except EngineError as exc:
            raise EngineError(f"{self.name}: warm-up failed: {exc.message}") from exc

    def _on_exit(self, returncode: int) -> None:
        self._ready = False
        self._accepting = False
        self._release_file()
        cause = describe_exit(returncode)
        if self._abandoned is not None and returncode == -signal.SIGKILL:
            cause = f"killed by the gateway: {self._abandoned}"
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
        for stream in list(self._streams.values()):  # a copy: each put runs its consumer
            stream.put_nowait(exc)

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Fan the worker's events out to their requests, until its output ends. Any
        failure here abandons the worker: nothing would ever read its answers again."""
        try:
            await self._pump(proc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a line over the limit (ValueError), or a bug: never silent
            self._abandon(proc, f"its output could not be read ({type(exc).__name__}: {exc})")
            return
        # The worker closed its stdout: it is dying. Fail what waits on it now (a warm-up
        # included), rather than when the supervisor notices the exit.
        if self._supervisor.process is not proc:
            return  # a worker we abandoned, already replaced
        self._accepting = False
        try:
            code = await asyncio.wait_for(proc.wait(), EXIT_GRACE_S)
        except TimeoutError:
            # Nothing it does can reach a request any more, and a process that never
            # exits is never restarted: kill it, unless a stop is already ending it.
            if not self._supervisor.stopping:
                late = f"it closed its output but was running {EXIT_GRACE_S:g} s later"
                self._abandon(proc, late)
            return
        cause = describe_exit(code)
        if self._supervisor.process is proc:
            # Not ready from the moment its requests learn it died, not from when the
            # supervisor's own wait for the exit happens to run.
            self._ready = False
            self._fail_all(
                EngineCrashedError(f"the worker serving {self.name} stopped unexpectedly: {cause}")
            )

    async def _pump(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            self._last_line_at = time.monotonic()
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.error("%s: unreadable line from the worker dropped", self.name)
                continue
            if not isinstance(event, dict):
                log.error("%s: a line from the worker that is not an event dropped", self.name)
                continue
            if event.get("ev") == "toks":  # one step's plain tokens: id, text, token, ...
                batch = event["b"]
                for i in range(0, len(batch), 3):
                    self._deliver(batch[i], TokenEvent(batch[i + 1], batch[i + 2]))
            else:
                self._deliver(str(event.get("id", "")), event)

    def _deliver(self, rid: str, item: _Item) -> None:
        stream = self._streams.get(rid)
        if stream is None:  # its caller left: this is the answer to the cancel, or before it
            if isinstance(item, dict) and item.get("ev") in ("fin", "err"):
                self._owed.pop(rid, None)
            return
        stream.put_nowait(item)
        if stream.qsize() >= STREAM_HIGH_WATER and rid not in self._paused:
            self._paused.add(rid)  # its reader is slow: stop decoding for it
            self._held.add(rid)
            self._post({"op": "pause", "id": rid})

    def _abandon(self, proc: asyncio.subprocess.Process, cause: str) -> None:
        """Give up on this worker: fail every request on it, kill it (the supervisor
        restarts it, counting the run like any other that ended badly), say why."""
        if self._supervisor.process is not proc or proc.returncode is not None:
            return  # already gone: its exit is being handled
        if self._abandoned is not None:
            return  # already given up on (by another request's timeout, say)
        log.error(
            "%s: abandoning worker %d with %d requests in flight: %s; killing it for a restart",
            self.name,
            proc.pid,
            len(self._streams),
            cause,
        )
        self._abandoned = cause
        self._ready = False
        self._accepting = False
        self._fail_all(EngineCrashedError(f"the worker serving {self.name} failed: {cause}"))
        self._supervisor.kill(cause)

    def _writable(self) -> asyncio.subprocess.Process:
        proc = self._supervisor.process
        if proc is None or proc.stdin is None or proc.returncode is not None or not self._accepting:
            raise EngineUnavailableError(f"branch {self.name} is not ready")
        return proc

    async def _send(self, command: dict[str, Any], timeout_s: float | None) -> None:
        """Write one command and wait, up to ``timeout_s``, until the pipe takes it."""
        proc = self._writable()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(command, separators=(",", ":")).encode() + b"\n")
        try:
            async with asyncio.timeout(timeout_s):
                await proc.stdin.drain()
        except TimeoutError as exc:  # its stdin is full and it reads nothing: stuck
            self._abandon(proc, f"it took no command for {timeout_s or 0:.0f}s")
            raise EngineError(
                f"branch {self.name}: the worker took no command for {timeout_s or 0:.0f}s",
                code="engine_timeout",
            ) from exc
        except ConnectionError as exc:  # it is dying; its exit fails the rest
            raise EngineUnavailableError(f"branch {self.name} is not ready") from exc

    def _post(self, command: dict[str, Any]) -> None:
        """Write a small command without waiting (a cancel, from a ``finally``)."""
        with contextlib.suppress(EngineError, ConnectionError):
            stdin = self._writable().stdin
            assert stdin is not None
            stdin.write(json.dumps(command, separators=(",", ":")).encode() + b"\n")

    async def _exchange(
        self,
        command: dict[str, Any],
        last: str,
        *,
        idle_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[dict[str, Any] | TokenEvent, None]:
        """Send ``command``; yield the worker's events for it up to the one named ``last``
        (a plain token already as a :class:`TokenEvent`).
        An ``err`` event, a dead worker, ``idle_timeout_s`` without an event or
        ``timeout_s`` in all raises; leaving early cancels the command."""
        rid = command["id"]
        proc, stream, timer = self._enter(rid, idle_timeout_s, timeout_s)
        done = False
        try:
            await self._send(command, timer.wait_s())
            while True:
                if not stream.items:
                    timer.waiting()
                    item = await stream.get()
                    timer.got()
                else:
                    item = stream.items.popleft()  # the common case under load
                if timer.expired is not None:
                    stuck_after_s = idle_timeout_s or timeout_s or 0.0
                    raise self._timed_out(proc, timer.expired, stuck_after_s)
                if rid in self._paused and stream.qsize() <= STREAM_LOW_WATER:
                    self._paused.discard(rid)
                    self._post({"op": "resume", "id": rid})
                if type(item) is TokenEvent:
                    yield item
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                assert isinstance(item, dict)
                if item["ev"] == "err":
                    done = True
                    raise _worker_error(self.name, item)
                done = item["ev"] == last
                yield item
                if done:
                    return
        finally:
            self._leave(rid, stream, timer, proc, done=done)

    def _enter(
        self, rid: str, idle_s: float | None, total_s: float | None
    ) -> tuple[asyncio.subprocess.Process, Inbox[_Item], ExchangeTimer]:
        """Open command ``rid``'s exchange (before its command is sent): the worker it goes
        to, its inbox (registered for the reader task) and its timer."""
        proc = self._writable()
        self._check_stuck(proc)
        inbox: Inbox[_Item] = Inbox()
        self._streams[rid] = inbox
        self._paused.discard(rid)
        timer = ExchangeTimer(
            asyncio.get_running_loop(), idle_s, total_s, lambda: inbox.put_nowait(TimeoutError())
        )
        self._owed[rid] = time.monotonic()
        return proc, inbox, timer

    def _leave(
        self,
        rid: str,
        inbox: Inbox[_Item],
        timer: ExchangeTimer,
        proc: asyncio.subprocess.Process,
        *,
        done: bool,
    ) -> None:
        """Close command ``rid``'s exchange, however it ended: forget it, and cancel it in
        the worker unless it ended there (``done``)."""
        inbox.notify = None
        timer.cancel()
        if self._streams.get(rid) is inbox:
            del self._streams[rid]
        self._paused.discard(rid)
        self._held.discard(rid)
        if done:
            self._owed.pop(rid, None)
        else:
            self._post({"op": "cancel", "id": rid})
            self._check_stuck(proc)

    def _check_stuck(self, proc: asyncio.subprocess.Process) -> None:
        """Abandon a worker that has sent nothing for ``gen_idle_timeout_s`` while owing
        an answer sent at least that long ago. Each request's own timer does this for the
        request that waits out the whole timeout; this is for callers that leave sooner
        (the gateway's first-token timeout): without it a wedged worker would take one
        request after another, each left before its timer, and never be replaced."""
        if not self._owed:
            return
        now = time.monotonic()
        idle_s = self._options.gen_idle_timeout_s
        if now - self._last_line_at >= idle_s and now - min(self._owed.values()) >= idle_s:
            silent_s = now - self._last_line_at
            self._abandon(proc, f"it sent nothing for {silent_s:.0f}s with commands unanswered")
        elif len(self._owed) > _OWED_MAX:  # answers that never came: forget the oldest
            for rid in sorted(self._owed, key=self._owed.__getitem__)[: len(self._owed) // 2]:
                del self._owed[rid]

    def _timed_out(
        self, proc: asyncio.subprocess.Process, wait_s: float, stuck_after_s: float
    ) -> EngineError:
        """A request waited ``wait_s`` in vain. A worker that has sent nothing at all for
        the whole timeout is stuck, and abandoned; one busy with others (or only quiet
        for the end of a scoring command's total) failed this request alone."""
        silent_s = time.monotonic() - self._last_line_at
        if silent_s >= stuck_after_s:
            self._abandon(proc, f"it sent nothing for {silent_s:.0f}s with requests waiting")
        return EngineError(
            f"branch {self.name}: no answer from the worker in {wait_s:.0f}s",
            code="engine_timeout",
        )

    # -- scoring --------------------------------------------------------------

    async def write_logits(
        self, prompt: str, tokens: list[int], path: Path, *, parse_special: bool = False
    ) -> ReferenceLogits:
        """Teacher-force ``tokens`` after ``prompt``; the worker writes the float32 logits
        that predicted each of them to ``path`` (see ``Engine.write_logits``)."""
        command = self._score_command("logits", prompt, tokens, parse_special)
        command["path"] = str(path)
        event = await self._score(command, "logits")
        n_tokens, n_vocab = (int(n) for n in event["shape"])
        return ReferenceLogits(Path(event["path"]), n_tokens, n_vocab)

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        """Teacher-force ``tokens`` after ``prompt``; the worker compares each row with
        ``reference``'s and returns per-token KLD and top-1 (see ``Engine.score``)."""
        command = self._score_command("score", prompt, tokens, parse_special)
        command["ref"] = {
            "path": str(reference.path),
            "shape": [reference.n_tokens, reference.n_vocab],
        }
        event = await self._score(command, "scores")
        kld = np.asarray(event["kld"], dtype=np.float64)  # [T]
        top1 = np.asarray(event["top1"], dtype=np.bool_)  # [T]
        if kld.shape != (len(tokens),) or top1.shape != (len(tokens),):
            raise EngineError(f"branch {self.name}: scores for the wrong number of tokens")
        return TokenScores(kld, top1)

    def _score_command(
        self, op: str, prompt: str, tokens: list[int], parse_special: bool
    ) -> dict[str, Any]:
        return {
            "op": op,
            "id": f"{op}.{next(self._ids)}",
            "prompt": prompt,
            "special": parse_special,
            "tokens": tokens,
        }

    async def _score(self, command: dict[str, Any], last: str) -> dict[str, Any]:
        events = self._exchange(command, last, timeout_s=self._options.score_timeout_s)
        async with contextlib.aclosing(events):
            async for item in events:
                if isinstance(item, dict) and item["ev"] == last:
                    return item
        raise EngineError(f"branch {self.name}: scoring ended without an answer")

    # -- generation -----------------------------------------------------------

    def generate(self, request: GenerationRequest) -> Generation:
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
                "min_p": s.min_p,
                "min_tokens": s.min_tokens,
                "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty,
                "repetition_penalty": s.repetition_penalty,
                "grammar": s.grammar,
                "deadline": s.deadline,
            },
        }
        if request.prompt_ids is not None:
            command["prompt_ids"] = list(request.prompt_ids)
        if request.trace_context:
            command["tc"] = dict(request.trace_context)
        return Generation(self, command, counted=request.request_id != _WARMUP)


class Generation:
    """One ``gen`` command's events, read one at a time (``async for``, ``anext``: the
    command is sent at the first read) or, once it is open, as a push source: every event
    that has come (:meth:`take_ready`), and ``notify`` called from the engine's reader
    task when one comes while nothing waits for it. A stream read this way needs no task
    of its own between the worker's pipe and its consumer (``api/run.py``: ``Run``).

    Either way: an ``err`` event, a dead worker or ``gen_idle_timeout_s`` without an event
    while the reader waits raises ``EngineError``; a reader that leaves before the end
    (:meth:`aclose`) cancels the command; one that lets ``STREAM_HIGH_WATER`` events pile
    up pauses the sequence in the worker until it has taken them."""

    def __init__(self, engine: LlamaCppEngine, command: dict[str, Any], *, counted: bool):
        self._engine = engine
        self._command = command
        self._rid: str = command["id"]
        self._counted = counted  # a start counted in the prompt cache's figures (not a warm-up)
        self._inbox: Inbox[_Item] | None = None
        self._timer: ExchangeTimer | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._done = False  # its last event came (or its error): the worker owes nothing
        self._closed = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> EngineEvent:
        inbox = self._inbox if self._inbox is not None else await self._open()
        timer = self._timer
        assert timer is not None
        while not self._closed:
            if inbox.items:
                item = inbox.items.popleft()  # the common case under load
            else:
                timer.waiting()
                try:
                    item = await inbox.get()
                except BaseException:  # cancelled: over, as a generator it would be
                    self._finish()
                    raise
                timer.got()
            event = self._event(item)
            if inbox.qsize() <= STREAM_LOW_WATER:
                self._resume()
            if event is not None:
                return event
        raise StopAsyncIteration

    def has_ready(self) -> bool:
        return bool(self._inbox is not None and self._inbox.items and not self._closed)

    def take_ready(self, tokens_only: bool = False) -> list[EngineEvent]:
        """Every event that has come and was not read yet, without waiting (its end
        included), or with ``tokens_only`` the plain tokens before anything else. An error
        raises, after the events before it were taken."""
        inbox, timer = self._inbox, self._timer
        if inbox is None or timer is None or self._closed:
            return []
        items = inbox.items
        events: list[EngineEvent] = []
        while items and not self._closed:
            item = items[0]
            if timer.expired is None:
                if type(item) is TokenEvent:  # the common case: a plain token
                    items.popleft()
                    events.append(item)
                    continue
                if tokens_only:
                    break
                failing = isinstance(item, BaseException) or (
                    isinstance(item, dict) and item.get("ev") == "err"
                )
            else:
                failing = True
            if failing and (events or tokens_only):
                break  # raised at the next call, after these are handed out
            event = self._event(items.popleft())
            if event is not None:
                events.append(event)
        if events:
            timer.got()
        if not items:
            timer.waiting()  # what comes next, it waits for (its idle clock runs)
            self._resume()
        return events

    @property
    def notify(self) -> Callable[[], None] | None:
        return None if self._inbox is None else self._inbox.notify

    @notify.setter
    def notify(self, callback: Callable[[], None] | None) -> None:
        if self._inbox is not None:  # a push source once it is open (its first read)
            self._inbox.notify = None if self._closed else callback

    async def aclose(self) -> None:
        self._finish()

    def __del__(self) -> None:
        # Dropped unread and unclosed (a caller that broke out of its loop): cancelled in
        # the worker, as an async generator's finalizer would do.
        if not self._closed:
            with contextlib.suppress(Exception):
                self._finish()

    async def _open(self) -> Inbox[_Item]:
        engine = self._engine
        idle_s = engine._options.gen_idle_timeout_s
        self._proc, inbox, timer = engine._enter(self._rid, idle_s, None)
        self._inbox, self._timer = inbox, timer
        try:
            await engine._send(self._command, timer.wait_s())
        except BaseException:
            self._finish()
            raise
        return inbox

    def _event(self, item: _Item) -> EngineEvent | None:
        """The event of one item (``None`` for one no reader sees); raises for an error.
        The generation is over after its end or an error."""
        engine = self._engine
        timer = self._timer
        assert timer is not None and self._proc is not None
        if timer.expired is not None:  # the worker may still answer: it is cancelled
            self._finish()
            raise engine._timed_out(self._proc, timer.expired, timer.expired)
        if isinstance(item, TokenEvent):
            return item
        if isinstance(item, BaseException) or item["ev"] == "err":  # nothing more will come
            self._done = True
            self._finish()
            if isinstance(item, BaseException):
                raise item
            raise _worker_error(engine.name, item)
        try:
            kind = item["ev"]
            if kind == "tok":  # a token with logprobs
                top = tuple((t, text, lp) for t, text, lp in item.get("top", ()))
                return TokenEvent(item["t"], item["tok"], item.get("lp"), item.get("p"), top)
            if kind == "start":
                start = StartEvent(item["pt"], item.get("c", 0))
                if self._counted:
                    engine._cache_stats.add(start)
                return start
            if kind == "fin":
                engine._supervisor.note_healthy()  # a finished generation: a healthy run
                finish = FinishEvent(
                    FinishReason(item["reason"]),
                    item["pt"],
                    item["ct"],
                    item["t"],
                    tuple(item.get("tm", ())),
                    self._rid in engine._held,
                )
                self._done = True
                self._finish()
                return finish
        except BaseException:
            self._finish()
            raise
        return None

    def _resume(self) -> None:
        engine = self._engine
        if self._rid in engine._paused and not self._closed:
            engine._paused.discard(self._rid)
            engine._post({"op": "resume", "id": self._rid})

    def _finish(self) -> None:
        """Over, however it ended: forget it; cancel it in the worker unless it ended there."""
        if self._closed:
            return
        self._closed = True
        if self._inbox is None or self._timer is None or self._proc is None:
            return  # never sent
        self._engine._leave(self._rid, self._inbox, self._timer, self._proc, done=self._done)


_OWED_MAX = 4096  # unanswered commands remembered per worker
_WARMUP = "warmup"  # the warm-up's request id (its prompt is not counted as traffic)
_CLIENT_ERRORS = {"invalid_grammar": "response_format", "grammar_too_long": "max_tokens"}


def _worker_error(branch: str, event: dict[str, Any]) -> Exception:
    if event.get("code") == "context_length_exceeded":
        return ContextLengthExceededError(
            prompt_tokens=event["pt"],
            max_tokens=event["max_tokens"],
            n_ctx=event["n_ctx"],
            at_least=bool(event.get("at_least")),
        )
    code = event.get("code")
    if code in _CLIENT_ERRORS:  # the request's own fault: a 400, not the branch's
        return InvalidRequestError(str(event.get("msg", "")), param=_CLIENT_ERRORS[code])
    if code == "device_out_of_memory":
        return DeviceOutOfMemoryError(f"branch {branch}: {event.get('msg', 'out of memory')}")
    return EngineError(
        f"branch {branch}: {event.get('msg', 'generation failed')}",
        code=code if isinstance(code, str) and code != "engine_error" else None,
    )

"""``LlamaCppEngine``: a branch served by a supervised llama.cpp worker process.

The gateway side of the worker protocol (the worker is :mod:`.worker`): one
reader task fans the worker's events out to per-request inboxes; a dead
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

A worker loads only the bytes that were verified (:mod:`.model_file`: the model, and an
ONNX branch's ``tokenizer.gguf``;
:meth:`LlamaCppEngine.file_moved` finds a rewrite in place). How it is
started, its argv and allowlisted environment, is :mod:`.options`; every
message to and from it is :mod:`.wire`; a generation's events are read by
:mod:`.generation`, and its scoring commands by :mod:`.scoring_exchange`. A reference may
hold a draft to speculate with (:meth:`LlamaCppEngine.speculate`, :mod:`.draft`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

from quantroute.engines.base import (
    EngineInfo,
    EngineListener,
    GenerationRequest,
    PromptCacheStats,
    SamplingParams,
    TokenEvent,
)
from quantroute.engines.exits import describe_exit
from quantroute.engines.inbox import Inbox
from quantroute.engines.llamacpp import wire
from quantroute.engines.llamacpp.draft import (
    Draft,
    DraftedFiles,
    SpeculationStats,
    drafts,
    routed_speedup,
)
from quantroute.engines.llamacpp.exchange_timer import ExchangeTimer
from quantroute.engines.llamacpp.generation import (
    STREAM_HIGH_WATER,
    Generation,
    Item,
)
from quantroute.engines.llamacpp.model_file import WorkerFiles
from quantroute.engines.llamacpp.options import PIPE_LINE_LIMIT_BYTES, WorkerOptions
from quantroute.engines.llamacpp.scoring_exchange import ScoringExchange
from quantroute.engines.supervisor import Launch, RestartPolicy, WorkerSupervisor
from quantroute.errors import (
    ArtifactIntegrityError,
    EngineCrashedError,
    EngineError,
    EngineUnavailableError,
)
from quantroute.registry.verified import VerifiedFile
from quantroute.tasks import cancel_and_wait
from quantroute.types import Offload

__all__ = [
    "PIPE_LINE_LIMIT_BYTES",
    "STREAM_HIGH_WATER",
    "Generation",
    "LlamaCppEngine",
    "WorkerOptions",
]

log = logging.getLogger(__name__)

EXIT_GRACE_S = 5.0
"""How long a worker that closed its output may take to exit before it is killed."""


class LlamaCppEngine(ScoringExchange):
    """Runs one GGUF file, or an ONNX folder's ``model.onnx`` (``options.backend`` "onnx",
    with its ``tokenizer``), in a worker process; see :class:`quantroute.engines.Engine`."""

    def __init__(
        self,
        name: str,
        model_path: Path,
        options: WorkerOptions,
        policy: RestartPolicy,
        *,
        listener: EngineListener | None = None,
        verified: VerifiedFile | None = None,
        tokenizer: VerifiedFile | Path | None = None,
        data: VerifiedFile | Path | None = None,
    ):
        self.name = name
        self._listener = listener
        self._model_path = model_path
        # the files as verified (None: a file nothing verified, tests' own; loaded by path);
        # an ONNX branch's tokenizer.gguf beside its model.onnx (options.backend "onnx"),
        # and its graph's external data file where it has one
        self._plain = WorkerFiles(model_path, verified, tokenizer, data)
        self._drafted: DraftedFiles | None = None  # with the draft speculate() gave it
        self._files: WorkerFiles | DraftedFiles = self._plain  # what its next worker loads
        self._draft: Draft | None = None  # what speculate() gave it
        self._draft_problem: str | None = None  # why its worker holds no draft, if it does not
        self._speculation = SpeculationStats()  # what drafting gave its current worker
        self._spec = 0  # what each gen asks to draft: the k_max while a draft is loaded
        self._options = options
        self._info: EngineInfo | None = None
        self._ready = False
        self._accepting = False  # the worker takes commands (the warm-up's, then everyone's)
        self._streams: dict[str, Inbox[Item]] = {}
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
            self._files.argv(options),
            on_start=self._on_start,
            on_exit=self._on_exit,
            on_failed=self._on_failed,
            policy=policy,
            env=options.env(),
            prepare=self._prepare if self._files.verified else None,
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
    def writes_logits(self) -> bool:
        return True

    @property
    def prompt_cache(self) -> PromptCacheStats:
        return self._cache_stats

    @property
    def options(self) -> WorkerOptions:
        return self._options

    @property
    def draft(self) -> Draft | None:
        """The draft its worker is started with (loaded or not: ``info.draft`` says)."""
        return self._draft if self._files is not self._plain else None

    @property
    def speculation(self) -> SpeculationStats:
        """What drafting gave its current worker (no drafted request yet: zeros)."""
        return self._speculation

    @property
    def draft_problem(self) -> str | None:
        """Why its worker holds no draft though it was given one (placement found no room
        beside the model, or the worker refused it); ``None`` otherwise."""
        return self._draft_problem if self._draft is not None else None

    def speculate(self, draft: Draft) -> None:
        """Start its workers with ``draft`` beside the model (before :meth:`start`; a
        verified draft only where the model is verified too): each generation then asks
        to draft up to ``draft.k_max`` tokens a step while the draft is loaded. A placement
        with no room for the draft (:meth:`offload`'s ``draft_dropped``) starts it without."""
        if self._draft is not None or (draft.verified is not None and not self._plain.verified):
            raise ValueError(f"{self.name}: one draft, and a verified one for a verified model")
        self._draft = draft
        self._files = self._drafted = DraftedFiles(self._plain, draft)
        self._options = replace(self._options, spec_mode=draft.mode, spec_k_max=draft.k_max)
        self._supervisor.argv = self._files.argv(self._options)

    def listen(self, listener: EngineListener) -> None:
        self._listener = listener

    def offload(self, offload: Offload) -> None:
        """Where its next worker runs (no worker runs now), and whether with its draft."""
        if self._drafted is not None:
            dropped = offload.draft_dropped
            self._files = self._drafted if dropped is None else self._plain
            self._draft_problem = dropped
        layers = offload.n_gpu_layers if offload.gpu is not None else 0
        self._options = replace(
            self._options,
            gpu=offload.gpu,
            n_gpu_layers=layers,
            oom_flag=offload.oom_flag,
            draft_gpu_layers=-1 if layers == -1 else 0,  # a whole reference's draft with it
        )
        self._supervisor.argv = self._files.argv(self._options)
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
        await cancel_and_wait(self._reader)
        self._files.release()
        self._fail_all(EngineUnavailableError(f"branch {self.name} is shutting down"))

    def file_moved(self) -> str | None:
        """Why the file the running worker loaded is no longer the verified one (it was
        rewritten in place), in words; ``None`` while it holds or no worker runs. A
        reload asks every engine; a branch whose file moved is killed, and its restart
        refuses the file (:meth:`_prepare`)."""
        return self._files.moved()

    def refuse(self, cause: str) -> None:
        """Kill the running worker because its file is no longer the verified one; the
        supervisor restarts it only through :meth:`_prepare`'s check."""
        log.error("%s: %s", self.name, cause)
        self._supervisor.kill(cause)

    # -- worker lifecycle -----------------------------------------------------

    async def _prepare(self) -> Launch:
        """Before each spawn: open the files and prove they hold the verified bytes (in a
        thread: it may read them whole); the worker loads those descriptors."""
        return await self._files.launch(self._options)

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
        try:
            hello = wire.decode_event(line)
        except wire.DecodeError as exc:
            raise EngineError(f"{self.name}: the worker's first line: {exc}") from exc
        if isinstance(hello, wire.Error):  # its model could not load: the worker says why
            raise EngineError(f"{self.name}: {hello.message or hello.code}")
        if not isinstance(hello, wire.Ready):
            raise EngineError(f"{self.name}: worker sent {type(hello).__name__} before Ready")
        self._check_loaded()
        self._info, self._spec = hello.info, 0
        self._speculation = SpeculationStats()
        if self.draft is not None and hello.draft is None:
            log.warning("%s: draft %s not loaded: no speculation", self.name, self.draft.branch_id)
            self._draft_problem = "its worker refused it (the worker's log says why)"
        elif self.draft is not None:
            self._info = replace(hello.info, draft=self.draft.branch_id)
            self._spec = self.draft.k_max
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
        self._files.release()
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
        readline, decode, deliver = proc.stdout.readline, wire.decode_event, self._deliver
        while line := await readline():
            self._last_line_at = time.monotonic()
            try:
                event = decode(line)
            except wire.DecodeError as exc:
                self._malformed(exc)
                continue
            if isinstance(event, wire.Tokens):  # one step's plain tokens: the common line
                for rid, text, token in event.batch:
                    deliver(rid, TokenEvent(text, token))
            elif isinstance(event, wire.Token):
                deliver(event.id, event.event())
            elif isinstance(event, wire.Ready):
                log.error("%s: a second 'ready' from the worker dropped", self.name)
            else:
                if isinstance(event, wire.Finished) and event.drafted:
                    self._drafted_one(event)
                deliver(event.id, event)

    def _drafted_one(self, fin: wire.Finished) -> None:
        """A drafted request finished: what it drafted and kept, and the worker's measured
        speed-up, which routing reads (in steps) through :attr:`info`."""
        stats = self._speculation.add(fin.drafted, fin.accepted, fin.mean_k, fin.speedup)
        self._speculation = stats
        speedup = routed_speedup(stats.speedup)
        if self._info is not None and self._info.speedup != speedup:
            self._info = replace(self._info, speedup=speedup)

    def _malformed(self, exc: wire.DecodeError) -> None:
        """A line that is not an event: a bug on one side. The request it was for (when
        its id could be read) fails, and is cancelled in the worker; the rest go on."""
        log.error("%s: a malformed event from the worker dropped: %s", self.name, exc)
        if exc.id is not None and exc.id in self._streams:
            self._deliver(exc.id, EngineError(f"branch {self.name}: the worker sent {exc}"))
            self._post(wire.Cancel(exc.id))

    def _deliver(self, rid: str, item: Item) -> None:
        stream = self._streams.get(rid)
        if stream is None:  # its caller left: this is the answer to the cancel, or before it
            if isinstance(item, _LAST):
                self._owed.pop(rid, None)
            return
        stream.put_nowait(item)
        if stream.qsize() >= STREAM_HIGH_WATER and rid not in self._paused:
            self._paused.add(rid)  # its reader is slow: stop decoding for it
            self._held.add(rid)
            self._post(wire.Pause(rid))

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

    async def _send(self, command: wire.Command, timeout_s: float | None) -> None:
        """Write one command and wait, up to ``timeout_s``, until the pipe takes it."""
        proc = self._writable()
        assert proc.stdin is not None
        proc.stdin.write(wire.encode(command))
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

    def _post(self, command: wire.Command) -> None:
        """Write a small command without waiting (a cancel, from a ``finally``)."""
        with contextlib.suppress(EngineError, ConnectionError):
            stdin = self._writable().stdin
            assert stdin is not None
            stdin.write(wire.encode(command))

    def _enter(
        self, rid: str, idle_s: float | None, total_s: float | None
    ) -> tuple[asyncio.subprocess.Process, Inbox[Item], ExchangeTimer]:
        """Open command ``rid``'s exchange (before its command is sent): the worker it goes
        to, its inbox (registered for the reader task) and its timer."""
        proc = self._writable()
        self._check_stuck(proc)
        inbox: Inbox[Item] = Inbox()
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
        inbox: Inbox[Item],
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
            self._post(wire.Cancel(rid))
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

    # -- generation -----------------------------------------------------------

    def generate(self, request: GenerationRequest) -> Generation:
        command = wire.Generate(
            f"{request.request_id}.{next(self._ids)}",
            request.prompt,
            request.sampling,  # as it is: every field of SamplingParams crosses the wire
            request.parse_special,
            request.prompt_ids,
            dict(request.trace_context) if request.trace_context else None,
            spec=self._spec if drafts(request.sampling) else 0,
        )
        return Generation(self, command, counted=request.request_id != _WARMUP)


_OWED_MAX = 4096  # unanswered commands remembered per worker
_WARMUP = "warmup"  # the warm-up's request id (its prompt is not counted as traffic)
_LAST = (wire.Finished, wire.Error, wire.Logits, wire.Scores)  # a command's last event

"""The ``Engine`` seam: what the gateway needs from anything that runs a branch.

An engine turns a :class:`GenerationRequest` into a stream of events::

    StartEvent(prompt_tokens, cached_tokens)   exactly once, first: the prompt was accepted
    TokenEvent(text, token_id, ...)    zero or more
    FinishEvent(reason, usage)         exactly once, last

Errors are raised from the iterator as :mod:`quantroute.errors` exceptions:
``ContextLengthExceededError`` before ``StartEvent``; ``EngineCrashedError``
when the worker dies mid-stream. Closing the iterator early (``aclose``, or a
cancelled task) cancels the generation in the engine.

Scoring (the drift monitor's teacher-forced replay) is two calls, so that no
vocabulary-sized array ever crosses a pipe or the gateway's memory::

    ref = await reference.write_logits(prompt, tokens, path)   # [T, V] float32 in a file
    scores = await branch.score(prompt, tokens, ref)            # TokenScores: [T] each
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from quantroute.types import Offload

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop sequence
    LENGTH = "length"  # max_tokens or the context window
    CANCELLED = "cancelled"  # the client went away
    DEADLINE = "deadline"  # the request's deadline passed mid-generation (what came is kept)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy.

    A llama.cpp worker gets this dataclass as it is (``engines/llamacpp/wire.py``
    carries it whole, typed and checked), so a new field is declared here, with a
    default, and read where it is used; no codec copies fields. Keep each field's type
    one the wire can check (ints, floats, bools, strings, tuples of them, ``None``)."""

    max_tokens: int = 16
    fit_context: bool = False  # max_tokens was not given: stop at the context window instead
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks)
    min_p: float = 0.0  # keep tokens at least this times as likely as the best; 0 is off
    min_tokens: int = 0  # no end-of-sequence before this many tokens
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, over prompt and generated tokens; 1 is off
    grammar: str | None = None  # GBNF the output must match (shaping/grammar.py)
    # The request's deadline, in time.monotonic() seconds (CLOCK_MONOTONIC: one clock for
    # every process on the machine); the engine stops generating when it passes.
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A chat request's conversation as the client sent it (validated), for an engine
    that takes messages and applies its own template (a remote OpenAI server); an engine
    that takes a rendered prompt reads ``GenerationRequest.prompt`` instead.
    ``response_format`` is the client's (the remote enforces it; ``SamplingParams.grammar``
    is its GBNF for engines that take grammars)."""

    messages: tuple[Mapping[str, Any], ...]
    response_format: Mapping[str, Any] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A text prompt, which the engine tokenizes (adding BOS), or ``prompt_ids``: token ids
    taken as they are (``prompt`` is then their text, for routing and logs)."""

    request_id: str
    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_ids: tuple[int, ...] | None = None
    # Parse special-token text (``<|im_start|>``) as special tokens: only for prompts a
    # model's chat template wrote, never for raw client text.
    parse_special: bool = False
    # W3C trace context (traceparent, tracestate, baggage) of the request's generation
    # span, for the engine to pass on: into its worker, or as headers of a remote call.
    trace_context: tuple[tuple[str, str], ...] = ()
    # a chat request's messages, for engines that take messages (``EngineKind.messages``)
    chat: ChatInput | None = None


@dataclass(frozen=True, slots=True)
class StartEvent:
    prompt_tokens: int
    cached_tokens: int = 0  # of them, reused from the engine's prompt cache (not prefilled)
    drafted: bool = False  # speculated: a draft proposes its tokens, the model verifies them


@dataclass(slots=True)
class PromptCacheStats:
    """An engine's prompt cache so far: the prompt tokens of the generations it started
    (warm-ups not counted) and how many of them came from cached KV cells."""

    enabled: bool = True
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, event: StartEvent) -> None:
        self.prompt_tokens += event.prompt_tokens
        self.cached_tokens += event.cached_tokens

    @property
    def hit_rate(self) -> float | None:
        """Reused tokens / prompt tokens; ``None`` before any prompt."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One sampled token. ``text`` is what it adds to the output: it may be empty
    (an incomplete UTF-8 sequence, or text held back as a possible stop
    sequence) and may carry held-back text of earlier tokens."""

    text: str
    token_id: int
    logprob: float | None = None
    piece: str | None = None  # the token's own text, with logprobs
    top_logprobs: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # held-back text released at the end (never part of a stop sequence)
    # a traced request: the engine's wall-clock ns (time.time_ns) when it admitted the
    # sequence, gave it a slot and finished it
    worker_ns: tuple[int, ...] = ()
    # the engine held the sequence at some point because its reader was slow (backpressure):
    # its timing says how fast the client read, not how fast the engine decoded
    held: bool = False
    # speculative decoding (a reference whose worker holds a draft): the tokens the draft
    # proposed, how many of them the reference kept, the mean proposed per step, and the
    # engine's measured decode speed drafting over plain (0: not measured)
    drafted: int = 0
    accepted: int = 0
    mean_k: float = 0.0
    speedup: float = 0.0


EngineEvent = StartEvent | TokenEvent | FinishEvent


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine learned from its model once loaded."""

    n_ctx: int  # context window per sequence
    n_ctx_train: int
    n_vocab: int
    parallel: int  # sequences decoded together
    chat_template: str | None
    bos_token: str
    eos_token: str
    model_bytes: int
    pid: int | None = None
    # the branch id of the draft the engine speculates with (``None``: it drafts nothing);
    # set by the gateway from what its worker loaded, never sent by a worker
    draft: str | None = None
    # its decode speed drafting over plain decoding's, as its worker measures it (1.0: no
    # draft, or not measured yet), in steps: routing multiplies the profile's decode speed
    # by it (``engines/llamacpp/draft.py``'s ``routed_speedup``); set by the gateway
    speedup: float = 1.0


@dataclass(frozen=True, slots=True)
class ReferenceLogits:
    """Teacher-forced logits one engine wrote to a file for another to compare with:
    ``n_tokens`` rows of ``n_vocab`` float32 (native byte order, row-major, no header);
    row ``t`` is the distribution that predicted token ``t``."""

    path: Path
    n_tokens: int
    n_vocab: int
    # the tokens the rows were taken on, when written for a text: the prompt's, then the
    # ``n_tokens`` scored ones (what a remote branch is sent, to compare the same ids)
    ids: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.n_tokens * self.n_vocab * 4


@dataclass(frozen=True, slots=True)
class TokenScores:
    """A branch against its reference on the same teacher-forced tokens, per token."""

    kld: npt.NDArray[np.float64]  # [T] KL(reference ‖ branch), nats; inf where the branch
    # gives no mass to a token the reference does
    top1: npt.NDArray[np.bool_]  # [T] both put their maximum on the same token


class PushSource(Protocol):
    """What an engine's generation stream may also be, once its first event was read: a
    source its consumer takes every event that has come from (``take_ready``, never
    waiting; an error raises after the events before it were taken; with
    ``tokens_only``, only the plain tokens before anything else), told by ``notify``
    (called in the engine's own task) when one comes. A run reads such streams in its
    reader's task, with no task of its own per stream (``api/run.py``: ``Run``)."""

    notify: Callable[[], None] | None

    def take_ready(self, tokens_only: bool = False) -> list[EngineEvent]: ...

    def has_ready(self) -> bool:
        """Whether anything has come that was not taken."""
        ...


def is_push_source(stream: object) -> TypeGuard[PushSource]:
    """Whether ``stream`` is a :class:`PushSource`, by its members, as a runtime-checkable
    protocol's ``isinstance`` would say, at the cost of three attribute lookups (0.1-0.2
    µs): that ``isinstance`` walks the protocol's members on every call (Python 3.11),
    12-25 µs here, and a streamed request asked it twice (docs/benchmarks.md, "A request's
    own cost, with the prompt cache on")."""
    return (
        hasattr(stream, "take_ready") and hasattr(stream, "has_ready") and hasattr(stream, "notify")
    )


class EngineListener(Protocol):
    """Told of an engine's lifecycle (placement and memory accounting live outside it)."""

    def engine_ready(self, engine: Engine) -> None:
        """Loaded and warmed up: it takes traffic from now on."""

    def engine_exited(self, engine: Engine, returncode: int) -> None:
        """Its process died unasked (it will be restarted unless it is failed)."""

    def engine_failed(self, engine: Engine, cause: str) -> None:
        """It failed too often in a row; it stays down until restarted (``cause`` in words)."""


@runtime_checkable
class Engine(Protocol):
    """Runs one branch. Implementations: ``LlamaCppEngine`` (a supervised worker
    process), ``FakeEngine`` (deterministic, for tests and demos).

    ``generate`` may be called concurrently; an engine serves several sequences
    at once. ``ready`` is false while starting, warming up, restarting or
    failed; ``generate`` then raises ``EngineUnavailableError`` at once rather
    than queueing. ``start`` returns once the engine is ready or its first start
    failed, and never raises for a bad model: the failure is the branch's
    (``failure``), not the caller's.

    What the gateway reads of any engine: ``name`` (the branch id), ``info``
    (once loaded), ``in_flight`` (sequences running or queued), ``pid`` (its
    process, for footprint measurement; ``None`` when it has none here),
    ``model_path`` (a local model file the memory model can read; ``None`` for
    a remote engine, which costs no local memory), ``failure`` (why it is
    failed, in words), ``can_score`` (whether ``score`` works: the branch compared
    with its reference on the same tokens, in the drift monitor's teacher-forced
    replay), ``writes_logits`` (whether ``write_logits`` works: the engine can be the
    reference of that replay; a remote one cannot), ``prompt_cache`` (its prompt
    cache's counts; ``None`` for an engine without one).
    """

    @property
    def name(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def info(self) -> EngineInfo | None: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def model_path(self) -> Path | None: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def can_score(self) -> bool: ...

    @property
    def writes_logits(self) -> bool: ...

    @property
    def prompt_cache(self) -> PromptCacheStats | None: ...

    def listen(self, listener: EngineListener) -> None:
        """Report lifecycle events to ``listener`` (one; a second call replaces it)."""

    def offload(self, offload: Offload) -> None:
        """Run on this device from the next start on."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def restart(self) -> None:
        """Clear a failure and start again (an operator's action)."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]: ...

    async def write_logits(
        self,
        prompt: str,
        tokens: list[int],
        path: Path,
        *,
        parse_special: bool = False,
        text: str | None = None,
        limit: int = 0,
    ) -> ReferenceLogits:
        """Teacher-force ``tokens`` after ``prompt`` and write the logits that predicted
        each of them to ``path`` (a new file, never an existing one: ``[len(tokens),
        n_vocab]`` float32). With ``text`` and no ``tokens``, the tokens are the first
        ``limit`` of ``text``'s, tokenized by this engine (a remote branch's answer,
        whose ids are unknown); the result's ``ids`` say which. Only where
        ``writes_logits``. The caller owns ``path`` and
        deletes it when done, whether the call succeeded or not: an engine removes the
        file of a job that failed or was cancelled, but one whose process died may
        leave it behind."""

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        """Teacher-force the same ``tokens`` after ``prompt`` and compare, token by token,
        with ``reference`` (another engine's :meth:`write_logits` of them): per-token
        ``KL(reference ‖ this)`` and top-1 agreement, computed where the distributions
        are (a remote engine's from its top logprobs: a lower bound of the KLD, on
        ``reference.ids``). Only where ``can_score``."""

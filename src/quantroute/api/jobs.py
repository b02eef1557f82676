"""A request in flight: the :class:`Job` the service prepared (:func:`build_job`); its
:class:`~quantroute.api.run.Run` on one branch is in ``api/run.py``."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import grammar_of, needs_grammar
from quantroute.engines.base import (
    ChatInput,
    GenerationRequest,
    SamplingParams,
)
from quantroute.engines.sampling import GREEDY_BELOW
from quantroute.engines.table import ENGINES
from quantroute.observability import NULL_TRACE, RequestTrace
from quantroute.resilience.admission import Ticket
from quantroute.resilience.tenants import OPEN, Tenant
from quantroute.routing.policy import Decision
from quantroute.routing.table import Branch
from quantroute.shaping.chat_template import ChatPrompt

Kind = Literal["chat", "completion"]


_SEED_MASK = 2**64 - 1
# engines known to take a rendered prompt: a chat request bound only for them needs no
# ChatInput. Any other engine (one that takes messages, or one the table does not
# know: a test's fake) gets it.
_RENDERED = frozenset(k.name for k in ENGINES.values() if k.prompt == "rendered")


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    kind: Kind
    decision: Decision
    branches: tuple[Branch, ...]  # the decision's branches, in its order
    requests: tuple[GenerationRequest, ...]  # one per choice index
    n: int  # choices per prompt: request i answers prompt i // n
    stream: bool
    include_usage: bool
    logprobs: bool
    deadline: float | None = None  # monotonic seconds; bounds the wait for the first token
    tenant: Tenant = OPEN
    ticket: Ticket | None = None  # its place among the model's running requests
    tools: bool = False  # read tool calls out of the replies (api/tools.py)
    parallel_tool_calls: bool = True
    trace: RequestTrace = NULL_TRACE  # its metrics, spans and log context


def request_grammar(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The GBNF a request's output must match (its ``response_format``; a chat request's
    forced tool calls), or ``None``; a 400 for a schema the grammar cannot enforce. The
    service has it worked out in a thread (``api/grammars.py``), after the tenant's limits
    and before the model's queue: a request that can never run does not wait there, nor
    take a place there."""
    if isinstance(req, ChatCompletionRequest):
        return grammar_of(req.response_format, req.tools, req.tool_choice, req.parallel_tool_calls)
    return grammar_of(req.response_format)


def takes_messages(branches: Iterable[Branch]) -> bool:
    """Whether some of ``branches`` runs an engine that may read a chat request's
    messages (``GenerationRequest.chat``) rather than its rendered prompt: one whose
    ``EngineKind.prompt`` is ``messages`` (a remote server), or one the engine table
    does not know."""
    return any(b.artifact.engine not in _RENDERED for b in branches)


def build_job(
    req: ChatCompletionRequest | CompletionRequest,
    decision: Decision,
    branches: tuple[Branch, ...],
    prompt: ChatPrompt | None,
    *,
    max_tokens: int,
    deadline: float | None,
    grammar: str | None,
    tenant: Tenant = OPEN,
    ticket: Ticket | None = None,
    trace: RequestTrace = NULL_TRACE,
    messages: Sequence[Mapping[str, Any]] | None = None,
) -> Job:
    """The engine requests of a validated request: one per choice (``n`` per prompt),
    with its sampling; ``prompt`` is the rendered chat prompt of a chat request, and
    ``grammar`` the request's :func:`request_grammar`.

    A chat request's engine requests carry its :class:`ChatInput` only where one of
    ``branches`` (the decision's: the ones the runner tries, or their successors after a
    reload) may read it (:func:`takes_messages`); for local branches alone the rendered
    prompt is all. ``messages``: the request's messages as
    ``ChatMessage.for_template`` gives them, the list its prompt was rendered from
    (``api.tools.template_messages`` copies, never changes it), reused as the
    ChatInput's; without it they are made here."""
    job_id = uuid.uuid4().hex
    seed = None if req.seed is None else req.seed & _SEED_MASK
    kind: Kind
    # Each kind's own fields first, then one SamplingParams: no copies (this is per request).
    if isinstance(req, ChatCompletionRequest):
        assert prompt is not None
        limit = req.completion_limit
        fit_context, logprobs = limit is None, req.logprobs
        stop, top_logprobs = req.stops + prompt.stops, req.top_logprobs or 0
        prompts = [prompt.text] * req.n
        ids = []
        special = prompt.template == "model"
        kind = "chat"
        chat_tools, parallel_tool_calls = bool(req.active_tools), req.parallel_tool_calls
        chat = _chat_input(req, messages) if takes_messages(branches) else None
    else:
        limit = req.max_tokens
        fit_context, logprobs = limit is None, req.logprobs is not None
        stop, top_logprobs = req.stops, req.logprobs or 0
        prompts = [p for p in req.prompts for _ in range(req.n)]
        ids = [tuple(p) for p in req.token_prompts or () for _ in range(req.n)]
        special = False
        kind = "completion"
        chat_tools, parallel_tool_calls = False, True
        chat = None
    sampling = SamplingParams(
        max_tokens=limit or max_tokens,
        fit_context=fit_context,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=req.bias,
        ignore_eos=req.ignore_eos,
        deadline=deadline,
        min_p=req.min_p,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        grammar=grammar,
    )
    requests = tuple(
        GenerationRequest(
            f"{job_id}.{i}",
            text,
            sampling if seed is None else replace(sampling, seed=(seed + i) & _SEED_MASK),
            parse_special=special,
            prompt_ids=ids[i] if ids else None,
            chat=chat,
        )
        for i, text in enumerate(prompts)
    )
    return Job(
        job_id,
        kind,
        decision,
        branches,
        requests,
        req.n,
        req.stream,
        req.include_usage,
        logprobs,
        deadline,
        tenant,
        ticket,
        tools=chat_tools,
        parallel_tool_calls=parallel_tool_calls,
        trace=trace,
    )


def _chat_input(
    req: ChatCompletionRequest, messages: Sequence[Mapping[str, Any]] | None
) -> ChatInput:
    """The client's conversation, ``response_format`` and tools, in OpenAI's shape."""
    fmt = req.response_format
    return ChatInput(
        tuple(m.for_template() for m in req.messages) if messages is None else tuple(messages),
        None if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True),
        tuple(t.model_dump(by_alias=True, exclude_none=True) for t in req.active_tools or ()),
    )


def drafted(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether a reference that speculates would draft for ``req``, as its engine and
    worker decide (``engines/llamacpp/draft.py`` ``drafts``, the worker's ``speculate``):
    not for a grammar, logprobs, penalties or seeded sampling, which decode plainly."""
    if isinstance(req, ChatCompletionRequest):
        tools, choice, logprobs = req.tools, req.tool_choice, req.logprobs
    else:  # a count: 0 still asks for the sampled token's
        tools, choice, logprobs = None, None, req.logprobs is not None
    sampled = req.temperature >= GREEDY_BELOW
    return not (
        needs_grammar(req.response_format, tools, choice)
        or logprobs
        or req.presence_penalty
        or req.frequency_penalty
        or req.repetition_penalty != 1.0
        or (sampled and req.seed is not None)
    )

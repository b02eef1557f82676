"""A request in flight: the :class:`Job` the service prepared (:func:`build_job`); its
:class:`~quantroute.api.run.Run` on one branch is in ``api/run.py``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Literal

from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import grammar_of
from quantroute.engines.base import (
    ChatInput,
    GenerationRequest,
    SamplingParams,
)
from quantroute.observability import NULL_TRACE, RequestTrace
from quantroute.resilience.admission import Ticket
from quantroute.resilience.tenants import OPEN, Tenant
from quantroute.routing.policy import Decision
from quantroute.routing.table import Branch
from quantroute.shaping.chat_template import ChatPrompt

Kind = Literal["chat", "completion"]


_SEED_MASK = 2**64 - 1


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
) -> Job:
    """The engine requests of a validated request: one per choice (``n`` per prompt),
    with its sampling; ``prompt`` is the rendered chat prompt of a chat request, and
    ``grammar`` the request's :func:`request_grammar`."""
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
        chat = ChatInput(
            tuple(m.for_template() for m in req.messages),
            None
            if req.response_format is None
            else req.response_format.model_dump(by_alias=True, exclude_none=True),
            tuple(t.model_dump(by_alias=True, exclude_none=True) for t in req.active_tools or ()),
        )
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

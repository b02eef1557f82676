"""What a remote OpenAI-compatible server is sent for one :class:`GenerationRequest`,
and what each kind of server takes.

A chat request goes to ``/chat/completions`` with the client's messages (the remote
applies its own chat template); a completion to ``/completions`` with the prompt's text
or token ids. OpenAI's own sampling fields are always forwarded; the extensions the
gateway also takes (vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``) go only to servers that take them, under their names
there, and a request that sets one for a server that does not is refused with a 400
naming the field — never silently sampled differently.

===============  =====  =====  ===================  ==========  ===========
field            vllm   sglang llama-server         quantroute  openai
===============  =====  =====  ===================  ==========  ===========
top_k            yes    yes    yes                  yes         refused
min_p            yes    yes    yes                  yes         refused
repetition_pen.  yes    yes    as ``repeat_penalty``  yes       refused
min_tokens       yes    yes    refused              yes         refused
ignore_eos       yes    yes    yes                  yes         refused
tools            refused everywhere (a remote's tool calls come back structured;
                 the gateway's stream carries text): served by local branches
===============  =====  =====  ===================  ==========  ===========
"""

from __future__ import annotations

from typing import Any

from quantroute.engines.base import GenerationRequest, SamplingParams
from quantroute.errors import UnsupportedByBranchError

__all__ = ["EXTENSIONS", "SERVERS", "body_of"]

SERVERS = ("vllm", "sglang", "llama-server", "quantroute", "openai")

# SamplingParams field -> (its default, its name per server that takes it)
EXTENSIONS: dict[str, tuple[object, dict[str, str]]] = {
    "top_k": (
        0,
        {"vllm": "top_k", "sglang": "top_k", "llama-server": "top_k", "quantroute": "top_k"},
    ),
    "min_p": (
        0.0,
        {"vllm": "min_p", "sglang": "min_p", "llama-server": "min_p", "quantroute": "min_p"},
    ),
    "repetition_penalty": (
        1.0,
        {
            "vllm": "repetition_penalty",
            "sglang": "repetition_penalty",
            "llama-server": "repeat_penalty",
            "quantroute": "repetition_penalty",
        },
    ),
    "min_tokens": (0, {"vllm": "min_tokens", "sglang": "min_tokens", "quantroute": "min_tokens"}),
    "ignore_eos": (
        False,
        {
            "vllm": "ignore_eos",
            "sglang": "ignore_eos",
            "llama-server": "ignore_eos",
            "quantroute": "ignore_eos",
        },
    ),
}


def body_of(
    request: GenerationRequest, model: str, server: str, *, logprobs: bool = True
) -> tuple[str, dict[str, Any]]:
    """The path (relative to the base URL) and JSON body for ``request`` on a ``server``
    (one of :data:`SERVERS`) serving ``model``. Raises :class:`UnsupportedByBranchError` for
    what that server cannot do as asked (an unpinned request moves to the next branch)."""
    s = request.sampling
    body: dict[str, Any] = {"model": model, "stream": True}
    chat = request.chat
    if chat is not None:
        if chat.tools:
            raise UnsupportedByBranchError(
                "tools are served by local branches only; this branch is remote",
                param="tools",
            )
        path = "/chat/completions"
        body["messages"] = list(chat.messages)
        if chat.response_format is not None:
            body["response_format"] = chat.response_format
    else:
        path = "/completions"
        body["prompt"] = (
            list(request.prompt_ids) if request.prompt_ids is not None else request.prompt
        )
    body["stream_options"] = {"include_usage": True}
    _sampling(body, s, chat is not None, server)
    if s.logprobs or s.top_logprobs:
        if not logprobs:
            raise UnsupportedByBranchError(
                "this remote branch returns no logprobs", param="logprobs"
            )
        if chat is not None:
            body["logprobs"] = True
            if s.top_logprobs:
                body["top_logprobs"] = s.top_logprobs
        else:
            body["logprobs"] = s.top_logprobs or 1 if s.logprobs else s.top_logprobs
    return path, body


def _sampling(body: dict[str, Any], s: SamplingParams, chat: bool, server: str) -> None:
    if not s.fit_context:
        body["max_completion_tokens" if chat and server == "openai" else "max_tokens"] = (
            s.max_tokens
        )
    body["temperature"] = s.temperature
    if s.top_p != 1.0:
        body["top_p"] = s.top_p
    if s.seed is not None:
        body["seed"] = s.seed if s.seed < 2**63 else s.seed - 2**64  # a signed 64-bit int
    if s.stop:
        body["stop"] = list(s.stop)
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    for field, (default, names) in EXTENSIONS.items():
        value = getattr(s, field)
        if value == default:
            continue
        name = names.get(server)
        if name is None:
            raise UnsupportedByBranchError(
                f"{field} is not taken by this remote branch's server ({server})", param=field
            )
        body[name] = value

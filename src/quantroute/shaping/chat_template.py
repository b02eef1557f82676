"""Chat messages to a prompt, with the model's own template or a default one.

A GGUF's ``tokenizer.chat_template`` is code from the model file, hostile
until shown otherwise. It renders in Jinja's immutable sandbox under a
budget (``template_sandbox``: a deadline, a character and a UTF-8 byte
limit, every value refused *before* it is built), and — unless its syntax
proves it bounded (``template_shape``) — in a render process the gateway
kills at the deadline (``template_pool``, with a memory limit of its own):

==============================================  =================================
template                                        renders
==============================================  =================================
the default one, or provably bounded; a small   on the event loop, under a small
conversation (:data:`INLINE_CONTENT_CHARS`,     budget (:data:`INLINE_S`, 256K
:data:`INLINE_MESSAGES`, no tools)              characters); past it, as below
the default one, any conversation               in a thread (our template: linear)
anything else                                   in a render process
==============================================  =================================

What a failure is, for the client:

==========================================  ======================================
the template calls ``raise_exception(msg)``  400 ``chat_template_refused``: it refused
                                             *this conversation* (roles that do not
                                             alternate, say) — the client can change it
it goes over its time, size or memory        400 ``chat_template_limit``: this
budget (or recursion depth)                  conversation is too much for the model's
                                             template; the gateway logs it, with the
                                             template's digest
it is unsafe, does not compile or raises     500 ``chat_template_error``: the
                                             operator's to fix
==========================================  ======================================

The default template, for models without one (the demo model)::

    ### System:
    {system content}
    ### User:
    {user content}
    ### Assistant:
    {assistant content}
    ### Assistant:        <- the generation prompt

with ``"\\n### "`` as an implied stop sequence, so a reply ends where the model
starts a new turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quantroute.errors import InvalidRequestError, QuantrouteError, TemplateError
from quantroute.shaping.template_pool import TemplatePool, default_pool
from quantroute.shaping.template_sandbox import (
    MAX_INT_BITS,
    Failed,
    LimitExceeded,
    Refused,
    Unsafe,
    compile_template,
    render_text,
)
from quantroute.shaping.template_shape import provably_bounded
from quantroute.shaping.template_worker import RenderJob

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_CHARS",
    "DEFAULT_STOPS",
    "DEFAULT_TEMPLATE",
    "DEFAULT_TIMEOUT_S",
    "MAX_INT_BITS",
    "ChatPrompt",
    "render_chat",
    "render_chat_bounded",
]

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "{% for m in messages %}### {{ m.role | capitalize }}:\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
DEFAULT_STOPS = ("\n### ",)
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CHARS = 1 << 24
DEFAULT_MAX_BYTES = 1 << 26


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    stops: tuple[str, ...]  # implied by the template
    template: str  # "model" or "default"


def render_chat(
    messages: Sequence[dict[str, Any]],
    *,
    model_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ChatPrompt:
    """Render ``messages`` for generation *on the calling thread*, under the sandbox's
    budget (see the module docstring for what each failure is); ``tools`` is the
    template's ``tools`` variable (OpenAI's shape; ``None`` when none). The BOS token
    is added by the tokenizer, so a template's leading ``bos_token`` is removed here
    rather than doubled. For templates the caller trusts (tests, the demo); the
    gateway uses :func:`render_chat_bounded`."""
    source = model_template or DEFAULT_TEMPLATE
    try:
        text = render_text(
            source,
            messages,
            tools,
            bos_token,
            eos_token,
            timeout_s=timeout_s,
            max_chars=max_chars,
            max_bytes=max_bytes,
        )
    except (LimitExceeded, Refused, Unsafe, Failed) as exc:
        raise _client_error(exc, source, timeout_s, max_chars, max_bytes, None) from None
    return _prompt(text, model_template, bos_token)


def _prompt(text: str, model_template: str | None, bos_token: str) -> ChatPrompt:
    if bos_token and text.startswith(bos_token):
        text = text[len(bos_token) :]
    if model_template:
        return ChatPrompt(text, (), "model")
    return ChatPrompt(text, DEFAULT_STOPS, "default")


# A small conversation with a template that is ours or provably bounded renders on the
# event loop, where a hand-off costs more than the render, under a budget of its own: at
# most INLINE_S and INLINE_MAX_CHARS (so no one operation of the template is long either).
# One that runs out of it renders again under the full budget, off the loop.
INLINE_S = 0.002
INLINE_MAX_CHARS = 1 << 18
INLINE_CONTENT_CHARS = 8192  # of message content, and no tools: what is tried on the loop
INLINE_MESSAGES = 64
VET_MAX_CHARS = 1 << 16  # a longer template is not parsed for the check: a render process
_VETTED: dict[str, bool] = {}  # template source -> provably bounded and compiles
_VETTED_MAX = 32


def _small(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    if tools or len(messages) > INLINE_MESSAGES:
        return False
    chars = 0
    for m in messages:
        content = m.get("content")
        chars += len(content) if isinstance(content, str) else INLINE_CONTENT_CHARS + 1
        if chars > INLINE_CONTENT_CHARS:
            return False
    return True


def _vet(source: str) -> bool:
    """Whether ``source`` may render in this process: short, provably bounded, and
    compiled (its compilation cached). Blocking: call it in a thread."""
    if len(source) > VET_MAX_CHARS or not provably_bounded(source):
        return False
    try:
        compile_template(source)
    except Exception:
        return False
    return True


async def render_chat_bounded(
    messages: Sequence[dict[str, Any]],
    *,
    model_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    where: str | None = None,
    pool: TemplatePool | None = None,
) -> ChatPrompt:
    """:func:`render_chat`, never holding the event loop for long (see the module
    docstring's table for where it renders). ``where`` names the model or branch in the
    log line a template over its budget leaves; ``pool`` is the render processes (the
    process's own by default)."""
    source = model_template or DEFAULT_TEMPLATE
    trusted = model_template is None
    if not trusted:
        vetted = _VETTED.get(source)
        if vetted is None:
            vetted = await asyncio.to_thread(_vet, source)
            if len(_VETTED) >= _VETTED_MAX:
                _VETTED.clear()
            _VETTED[source] = vetted
        trusted = vetted
    args = (source, messages, tools, bos_token, eos_token)
    limits = (timeout_s, max_chars, max_bytes)
    try:
        if trusted and timeout_s > INLINE_S and _small(messages, tools):
            try:
                text = render_text(
                    *args,
                    timeout_s=INLINE_S,
                    max_chars=min(max_chars, INLINE_MAX_CHARS),
                    max_bytes=min(max_bytes, INLINE_MAX_CHARS),
                )
                return _prompt(text, model_template, bos_token)
            except LimitExceeded:
                pass  # over the small budget: the full one decides, off the loop
        if model_template is None:
            text = await asyncio.to_thread(
                render_text, *args, timeout_s=timeout_s, max_chars=max_chars, max_bytes=max_bytes
            )
        else:
            job = RenderJob(source, list(messages), tools, bos_token, eos_token, *limits)
            text = await (pool or default_pool()).render(job)
    except (LimitExceeded, Refused, Unsafe, Failed) as exc:
        raise _client_error(exc, source, *limits, where) from None
    return _prompt(text, model_template, bos_token)


def _client_error(
    exc: Exception,
    source: str,
    timeout_s: float,
    max_chars: int,
    max_bytes: int,
    where: str | None,
) -> QuantrouteError:
    """The error a client sees for one of the sandbox's exceptions (never its text:
    it may hold the conversation), and the gateway's log line for a broken template."""
    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    if isinstance(exc, Refused):
        return InvalidRequestError(
            f"the model's chat template refused the conversation: {exc}",
            param="messages",
            code="chat_template_refused",
        )
    if isinstance(exc, LimitExceeded):
        budget = {
            "time": f"time budget ({timeout_s:g} s)",
            "memory": f"memory budget ({max_bytes} bytes)",
            "depth": "recursion budget",
        }.get(exc.what, f"size budget ({max_chars} characters, {max_bytes} bytes)")
        logger.warning(
            "the chat template %s of %s exceeded its %s; the request was refused (400)",
            digest,
            where or "a model",
            budget,
        )
        return InvalidRequestError(
            f"the model's chat template exceeded its {budget} rendering this conversation",
            param="messages",
            code="chat_template_limit",
        )
    if isinstance(exc, Unsafe):
        logger.warning("the chat template %s of %s tried an unsafe operation", digest, where)
        return TemplateError("the model's chat template tried an unsafe operation and was stopped")
    logger.warning("the chat template %s of %s failed: %s", digest, where, exc)
    return TemplateError(f"the model's chat template failed: {exc}")

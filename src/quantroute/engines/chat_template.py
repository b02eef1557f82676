"""Chat messages to a prompt, with the model's own template or a default one.

A GGUF's ``tokenizer.chat_template`` is code from the model file: it is
rendered only in Jinja's immutable sandbox, so a template that reaches for
``__globals__`` (or anything else unsafe) executes nothing and the request
gets a ``TemplateError``.

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

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quantroute.errors import TemplateError

DEFAULT_TEMPLATE = (
    "{% for m in messages %}### {{ m.role | capitalize }}:\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
DEFAULT_STOPS = ("\n### ",)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    stops: tuple[str, ...]  # implied by the template
    template: str  # "model" or "default"


def _raise(message: str) -> NoReturn:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    messages: Sequence[dict[str, Any]],
    *,
    model_template: str | None,
    bos_token: str = "",
    eos_token: str = "",
) -> ChatPrompt:
    """Render ``messages`` for generation. The BOS token is added by the tokenizer,
    so a template's leading ``bos_token`` is removed here rather than doubled."""
    source = model_template or DEFAULT_TEMPLATE
    try:
        text = _compile(source).render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(
            "the model's chat template tried an unsafe operation and was stopped"
        ) from exc
    except Exception as exc:  # template code is the model's: any failure is its failure
        raise TemplateError(f"the model's chat template failed: {type(exc).__name__}") from exc
    if bos_token and text.startswith(bos_token):
        text = text[len(bos_token) :]
    if model_template:
        return ChatPrompt(text, (), "model")
    return ChatPrompt(text, DEFAULT_STOPS, "default")

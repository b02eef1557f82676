"""Chat messages to a prompt, with the model's own template or a default one.

A GGUF's ``tokenizer.chat_template`` is code from the model file. It is
rendered in Jinja's immutable sandbox, so a template that reaches for
``__globals__`` (or anything else unsafe) executes nothing, and under a
*budget* — a deadline and a character limit — so a template that loops or
grows without end stops instead of burning a core or the gateway's memory:

- the deadline is checked on every iteration of every ``{% for %}`` (the
  loop's iterable is wrapped when the template is compiled), every call,
  filter, attribute and item access, so a runaway template stops within
  microseconds of it wherever it loops;
- every string, list or output the template builds (``~``, ``+``, ``*``,
  ``%``, ``format``, string methods, filters, macro and block bodies, the
  prompt itself) is refused when it would pass ``max_chars``, *before* one
  C-level operation builds it (``'x' * 10**10``, ``'%09999999999d' % 1``,
  ``s|indent(big)``, ``s.replace(a, big)``); integers stay under
  :data:`MAX_INT_BITS` (``2 ** 10**10``).

:func:`render_chat_bounded` renders a small conversation on the event loop under a small
budget of its own (2 ms, 256K characters), when the template's last render in a thread was
fast; anything else, and whatever runs out of that budget, in a thread, off the loop.

What a failure is, for the client:

==========================================  ======================================
the template calls ``raise_exception(msg)``  400 ``chat_template_refused``: it refused
                                             *this conversation* (roles that do not
                                             alternate, say) — the client can change it
it passes the deadline or ``max_chars``      500 ``chat_template_limit``: the model's
                                             template is broken; the operator's to fix
it is unsafe, does not compile or raises     500 ``chat_template_error``
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
import contextlib
import contextvars
import datetime
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NoReturn, cast

import jinja2
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from quantroute.errors import InvalidRequestError, TemplateError

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_STOPS",
    "DEFAULT_TEMPLATE",
    "DEFAULT_TIMEOUT_S",
    "MAX_INT_BITS",
    "ChatPrompt",
    "render_chat",
    "render_chat_bounded",
]

DEFAULT_TEMPLATE = (
    "{% for m in messages %}### {{ m.role | capitalize }}:\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)
DEFAULT_STOPS = ("\n### ",)
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CHARS = 1 << 24
#: The largest integer a template may make (``2 ** 10**10`` would take minutes in C).
MAX_INT_BITS = 1 << 16
_REFUSAL_CHARS = 300  # of a template's raise_exception message
_MAX_JSON_INDENT = 64
# All the strings and lists a template makes, together, at most this many times
# max_chars: each may be under the limit, a million of them are not.
_MADE_FACTOR = 32
_BACKSTOP_S = 0.5  # beyond the deadline, before the caller stops waiting for the thread


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    stops: tuple[str, ...]  # implied by the template
    template: str  # "model" or "default"


# ---- the budget ---------------------------------------------------------------------------------


class _LimitExceeded(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _Refused(Exception):
    """``raise_exception`` in a template: it refuses the conversation."""


@dataclass(slots=True)
class _Budget:
    deadline: float  # time.monotonic()
    max_chars: int
    made: int = 0  # characters (and items) of every value the template has made so far

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded("time")

    def chars(self, n: int) -> None:
        if n > self.max_chars:
            raise _LimitExceeded("size")

    def text(self, *values: object) -> None:
        """Refuse to turn ``values`` into text over ``max_chars`` (a list holding one
        string many times is small until ``str()`` spells it out)."""
        self.chars(sum(_text_size(v, self.max_chars) for v in values))

    def make(self, value: object) -> None:
        """Account for a value the template made: no one value, nor all of them
        together, may be bigger than the limits allow."""
        if isinstance(value, str | list | tuple | dict):
            self.chars(len(value))
            self.made += len(value)
            if self.made > _MADE_FACTOR * self.max_chars:
                raise _LimitExceeded("size")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise _LimitExceeded("size")


def _text_size(value: object, limit: int) -> int:
    """About how long ``str(value)`` is, counting no further than past ``limit``."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v)
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, float):
            total += 24
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, Namespace):
            total += 16
            stack.append(object.__getattribute__(v, "_Namespace__attrs"))
        else:
            total += 64  # Undefined, macros, loop contexts, cyclers: a short repr
    return total


# Set for the duration of one render, in the thread that renders; the hooks below
# read it. A key, not state: each render sets and resets its own value.
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


# ---- estimates: what one operation would build, before it builds it -----------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*:[^{}]*\{")
_DIGITS = re.compile(r"\d+")
# Filters that turn their value into text (the rest move items around).
_TEXT_FILTERS = frozenset(
    {
        "capitalize", "center", "e", "escape", "filesizeformat", "forceescape", "format",
        "indent", "join", "lower", "pprint", "replace", "safe", "string", "striptags", "title",
        "tojson", "trim", "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap",
        "xmlattr",
    }
)  # fmt: skip


def _ints(*groups: Iterable[object]) -> Iterator[int]:
    for group in groups:
        for v in group:
            if isinstance(v, int) and not isinstance(v, bool):
                yield abs(v)


def _no_big_ints(b: _Budget, *groups: Iterable[object]) -> None:
    """No integer argument may be over ``max_chars`` (widths, counts, sizes)."""
    if any(v > b.max_chars for v in _ints(*groups)):
        raise _LimitExceeded("size")


def _width(b: _Budget, digits: str) -> None:
    b.chars(int(digits) if len(digits) <= 12 else b.max_chars + 1)


def _percent(b: _Budget, fmt: str, args: object) -> None:
    b.text(fmt, args)
    values = args if isinstance(args, tuple) else (args,)
    for spec in _PERCENT_SPEC.finditer(fmt):
        for part in spec.groups():
            if part == "*":
                _no_big_ints(b, values)
            elif part is not None:
                _width(b, part)


def _brace(b: _Budget, fmt: str, args: Sequence[object], kwargs: dict[str, Any]) -> None:
    b.text(fmt, *args, *kwargs.values())
    for spec in _BRACE_SPEC.finditer(fmt):
        for digits in _DIGITS.findall(spec.group(1)):
            _width(b, digits)
    if _NESTED_FIELD.search(fmt):
        _no_big_ints(b, args, kwargs.values())


def _replace(b: _Budget, s: str, old: object, new: object) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = len(s) + 1 if not old else s.count(old)
        b.chars(len(s) + hits * (len(new) - len(old)))


def _sized(items: Any) -> Any:
    """``items`` as something with a length: a generator is drawn out (with ticks)."""
    return items if hasattr(items, "__len__") else list(_iterate(items))


def _joined(b: _Budget, sep: object, seq: Any) -> None:
    if isinstance(sep, str) and hasattr(seq, "__len__"):
        b.chars(len(seq) * (len(sep) + 1))
        if isinstance(seq, list | tuple):
            b.chars(len(seq) * len(sep) + _text_size(seq, b.max_chars))


def _int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise _LimitExceeded("size")


def _binop(b: _Budget, op: str, left: object, right: object) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(n, int):
                b.chars(len(seq) * max(n, 0))
        if isinstance(left, int) and isinstance(right, int):
            _int_bits(left.bit_length() + right.bit_length())
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _int_bits(left.bit_length() * right)
    elif op == "+":
        if isinstance(left, str | list | tuple) and type(left) is type(right):
            b.chars(len(left) + len(right))
    elif op == "%" and isinstance(left, str):
        _percent(b, left, right)


def _str_method(b: _Budget, s: str, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Check ``s.name(*args)`` (str methods reach ``call`` as bound builtins); the
    arguments to call it with."""
    _no_big_ints(b, args)
    if name == "replace" and len(args) >= 2:
        _replace(b, s, args[0], args[1])
    elif name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else 8
        b.chars(len(s) + s.count("\t") * max(size, 0))
    elif name == "join" and args:
        args = (_sized(args[0]), *args[1:])
        _joined(b, s, args[0])
    elif name == "translate":
        raise _LimitExceeded("size")  # a table can map each character to a string
    return args


def _filter(b: _Budget, name: str, value: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """Check ``value|name(*args, **kw)``; the value to call it with."""
    if name in _TEXT_FILTERS:
        if name == "join":
            value = _sized(value)
            _joined(b, args[0] if args else kw.get("d", ""), value)
        b.text(value)
    if name == "tojson":
        indent = args[0] if args else kw.get("indent")
        if isinstance(indent, int) and indent > _MAX_JSON_INDENT:
            raise _LimitExceeded("size")
        return value
    _no_big_ints(b, args, kw.values())
    text = value if isinstance(value, str) else None
    if text is None:
        return value
    if name == "replace" and len(args) >= 2:
        _replace(b, text, args[0], args[1])
    elif name == "indent":
        width = args[0] if args else kw.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        b.chars(len(text) + (text.count("\n") + 1) * per_line)
    elif name == "wordwrap":
        width = args[0] if args else kw.get("width", 79)
        wrap = args[2] if len(args) > 2 else kw.get("wrapstring")
        if isinstance(width, int) and isinstance(wrap, str):
            lines = len(text) // max(width, 1) + text.count("\n") + 1
            b.chars(len(text) + lines * len(wrap))
    elif name == "format":
        _percent(b, text, tuple(args) or kw)
    return value


# ---- the sandbox --------------------------------------------------------------------------------


class _Guard(NodeTransformer):
    """Route every ``for`` loop's iterable through ``environment.qr_iter`` and every
    ``~`` through ``environment.qr_concat``. Environment attributes, not names: a
    template cannot shadow them with ``{% set %}``."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)  # in place
        node.iter = _hook("qr_iter", [cast(nodes.Expr, node.iter)], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _hook("qr_concat", list(node.nodes), node.lineno)


def _hook(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)


def _iterate(iterable: Iterable[Any]) -> Iterator[Any]:
    b = _BUDGET.get()
    for item in iterable:
        if b is not None:
            b.tick()
        yield item


def _concat_parts(*parts: object) -> str:
    b = _BUDGET.get()
    if b is not None:
        b.text(*parts)
    return _joined_output(str(p) for p in parts)


def _finalize(value: object) -> object:
    """Every ``{{ expression }}``, before ``str()`` spells it out."""
    b = _BUDGET.get()
    if b is not None:
        b.text(value)
    return value


def _joined_output(parts: Iterable[str]) -> str:
    """``"".join`` that counts: the template's output, macro and block bodies."""
    b = _BUDGET.get()
    if b is None:
        return "".join(parts)
    out: list[str] = []
    n = 0
    for part in parts:
        n += len(part)
        b.chars(n)
        out.append(part)
    text = "".join(out)
    b.make(text)
    return text


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # Filters that take the context, eval context or environment get it first.
    first = 2 if hasattr(func, "jinja_pass_arg") else 1

    @functools.wraps(func)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = _BUDGET.get()
        if b is not None and len(args) >= first:
            b.tick()
            value = _filter(b, name, args[first - 1], args[first:], kwargs)
            args = (*args[: first - 1], value, *args[first:])
        result = func(*args, **kwargs)
        if b is not None:
            b.make(result)
        return result

    return bounded


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the budget's checks at every hook Jinja offers."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        # optimized=False: no constant folding of expressions at compile time.
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            autoescape=False,
            optimized=False,
            finalize=_finalize,
        )
        self.filters = {n: _bounded_filter(n, f) for n, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # n paragraphs of lorem ipsum: no template needs it
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = _strftime_now
        self.qr_iter = _iterate
        self.qr_concat = _concat_parts
        self.concat = _joined_output  # type: ignore[method-assign]

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
        result = super().getitem(obj, argument)
        if b is not None and isinstance(argument, slice):
            b.make(result)  # a slice is a copy
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            _binop(b, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if b is not None:
            b.make(result)
        return result

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = _BUDGET.get()
        if b is not None:
            b.tick()
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, str) and isinstance(getattr(obj, "__name__", None), str):
                args = _str_method(b, owner, obj.__name__, args)
        result = super().call(context, obj, *args, **kwargs)
        if b is not None:
            b.make(result)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        fmt: str = value.__self__
        inner = sandboxed

        def checked(*args: Any, **kwargs: Any) -> str:
            b = _BUDGET.get()
            if b is not None:
                _brace(b, fmt, args, kwargs)
            return inner(*args, **kwargs)

        return checked


def _raise(message: object) -> NoReturn:
    raise _Refused(str(message)[:_REFUSAL_CHARS])


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedSandbox()
    return env.from_string(_Guard().visit(env.parse(source)))


# ---- rendering ----------------------------------------------------------------------------------


def render_chat(
    messages: Sequence[dict[str, Any]],
    *,
    model_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> ChatPrompt:
    """Render ``messages`` for generation, on the calling thread, within ``timeout_s``
    and ``max_chars`` (see the module docstring for what each failure is); ``tools`` is
    the template's ``tools`` variable (OpenAI's shape; ``None`` when none). The BOS
    token is added by the tokenizer, so a template's leading ``bos_token`` is removed
    here rather than doubled."""
    try:
        return _render(messages, model_template, tools, bos_token, eos_token, timeout_s, max_chars)
    except _LimitExceeded as exc:
        raise _limit_error(exc.what, timeout_s, max_chars) from None


def _render(
    messages: Sequence[dict[str, Any]],
    model_template: str | None,
    tools: list[dict[str, Any]] | None,
    bos_token: str,
    eos_token: str,
    timeout_s: float,
    max_chars: int,
) -> ChatPrompt:
    """:func:`render_chat`, but a budget it runs out of raises :class:`_LimitExceeded`."""
    source = model_template or DEFAULT_TEMPLATE
    budget = _Budget(time.monotonic() + timeout_s, max_chars)
    token = _BUDGET.set(budget)
    try:
        text = _compile(source).render(
            messages=list(messages),
            add_generation_prompt=True,
            tools=tools,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except _Refused as exc:
        raise InvalidRequestError(
            f"the model's chat template refused the conversation: {exc}",
            param="messages",
            code="chat_template_refused",
        ) from None
    except _LimitExceeded:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(
            "the model's chat template tried an unsafe operation and was stopped"
        ) from exc
    except Exception as exc:  # template code is the model's: any failure is its failure
        raise TemplateError(f"the model's chat template failed: {type(exc).__name__}") from exc
    finally:
        _BUDGET.reset(token)
    if bos_token and text.startswith(bos_token):
        text = text[len(bos_token) :]
    if model_template:
        return ChatPrompt(text, (), "model")
    return ChatPrompt(text, DEFAULT_STOPS, "default")


# A small conversation is rendered on the event loop, where a thread's hand-off costs more
# than the render, under a budget of its own: at most INLINE_S and INLINE_MAX_CHARS (so no
# one C-level operation of the template is long either). Only with a template whose last
# render in a thread took under a quarter of INLINE_S (it is compiled, and fast); one that
# runs out of the small budget is rendered again in a thread, under the full one, and goes
# back to threads until a thread render is fast again.
INLINE_S = 0.002
INLINE_MAX_CHARS = 1 << 18
INLINE_CONTENT_CHARS = 8192  # of message content, and no tools: what is tried on the loop
_FAST: set[str] = set()  # template sources fast enough for the loop
_FAST_MAX = 32


def _small(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    if tools:
        return False
    chars = 0
    for m in messages:
        content = m.get("content")
        chars += len(content) if isinstance(content, str) else INLINE_CONTENT_CHARS + 1
        if chars > INLINE_CONTENT_CHARS:
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
) -> ChatPrompt:
    """:func:`render_chat`, never holding the event loop for long: a small conversation
    with a template known to be fast on the loop under a small budget of its own
    (:data:`INLINE_S`), anything else in a worker thread. The budget stops the template
    in its thread at ``timeout_s``; should one C-level operation still hold it, the
    caller stops waiting shortly after and gets the same ``chat_template_limit`` error."""
    source = model_template or DEFAULT_TEMPLATE
    if source in _FAST and timeout_s > INLINE_S and _small(messages, tools):
        inline_chars = min(max_chars, INLINE_MAX_CHARS)
        try:
            return _render(
                messages, model_template, tools, bos_token, eos_token, INLINE_S, inline_chars
            )
        except _LimitExceeded:
            _FAST.discard(source)  # over the small budget: the thread says what it is
    args = (messages, model_template, tools, bos_token, eos_token, timeout_s, max_chars)
    try:
        async with asyncio.timeout(timeout_s + _BACKSTOP_S):
            prompt, took_s = await asyncio.to_thread(_timed_render, *args)
    except TimeoutError:
        raise _limit_error("time", timeout_s, max_chars) from None
    except _LimitExceeded as exc:
        raise _limit_error(exc.what, timeout_s, max_chars) from None
    if took_s < INLINE_S / 4:
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST.add(source)
    return prompt


def _timed_render(*args: Any) -> tuple[ChatPrompt, float]:
    """:func:`_render` and how long it took, its template's compilation left out."""
    with contextlib.suppress(Exception):  # one that does not compile fails in _render
        _compile(args[1] or DEFAULT_TEMPLATE)
    start = time.monotonic()
    prompt = _render(*args)
    return prompt, time.monotonic() - start


def _limit_error(what: str, timeout_s: float, max_chars: int) -> TemplateError:
    limit = f"time limit of {timeout_s:g} s" if what == "time" else f"{max_chars}-character limit"
    return TemplateError(
        f"the model's chat template went over its {limit} rendering this conversation; "
        "the model's template needs fixing",
        code="chat_template_limit",
    )

"""The chat template sandbox: Jinja's immutable sandbox under a *budget*.

A GGUF's ``tokenizer.chat_template`` is code from the model file, so it is
rendered in Jinja's immutable sandbox (a template that reaches for
``__globals__`` executes nothing) and under a budget — a deadline, a
character limit and a byte limit — so a template that loops or grows
without end stops instead of burning a core or memory:

- the deadline is checked on every iteration of every ``{% for %}`` (the
  loop's iterable is wrapped when the template is compiled), every call,
  filter, attribute and item access;
- every string, list or output the template builds (``~``, ``+``, ``*``,
  ``%``, ``format``, string methods, filters, macro and block bodies, the
  prompt itself) is refused when it would pass ``max_chars`` characters or
  ``max_bytes`` bytes, *before* one C-level operation builds it. Bytes are
  UTF-8 bytes, bounded in O(1): a string's length when it is ASCII, four
  times its length otherwise (an emoji is one character and four bytes);
- integers stay under :data:`MAX_INT_BITS`; a ``str.format`` field's spec is
  at most :data:`MAX_FORMAT_SPEC` characters (a field that does not parse
  as one is refused too); ``strftime_now`` takes a short format of known
  directives only;
- the sandbox's own checks scan the template's strings once, left to right
  (no regular expressions, nothing that backtracks).

The checks are a *second* line: what runs a template that is not provably
bounded (:mod:`~quantroute.shaping.template_shape`) is a render process
(:mod:`~quantroute.shaping.template_pool`) with its own memory limit and a
wall clock after which it is killed, so no C-level operation the checks do
not foresee can hold the gateway.

:func:`render_text` raises :class:`LimitExceeded`, :class:`Refused`,
:class:`Unsafe` or :class:`Failed`; callers turn them into the errors a
client sees (``engines.chat_template``).
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any, NoReturn, cast

import jinja2
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from quantroute.shaping.template_budget import (
    BUDGET,
    MAX_FORMAT_SPEC,
    MAX_INT_BITS,
    Budget,
    LimitExceeded,
    check_binop,
    check_brace,
    check_filter,
    check_str_method,
    iterate,
    utf8_bound,
)

__all__ = [
    "MAX_FORMAT_SPEC",
    "MAX_INT_BITS",
    "MAX_STRFTIME_FORMAT",
    "Failed",
    "LimitExceeded",
    "Refused",
    "Unsafe",
    "compile_template",
    "render_text",
    "utf8_bound",
]

#: The longest format ``strftime_now`` takes.
MAX_STRFTIME_FORMAT = 64
# strftime directives a template may use (C89's, no widths, and glibc's "-" for no padding)
_STRFTIME_DIRECTIVES = frozenset("aAbBcdHIjmMpSUwWxXyYzZ%")
_REFUSAL_CHARS = 300  # of a template's raise_exception message


class Refused(Exception):
    """``raise_exception`` in a template: it refuses the conversation."""


class Unsafe(Exception):
    """The template tried an operation the sandbox forbids."""


class Failed(Exception):
    """The template failed otherwise: does not compile, or raised; the message is the
    exception's type name (never its text, which may hold the conversation)."""


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


def _concat_parts(*parts: object) -> str:
    b = BUDGET.get()
    if b is not None:
        b.text(*parts)
    return _joined_output(str(p) for p in parts)


def _finalize(value: object) -> object:
    """Every ``{{ expression }}``, before ``str()`` spells it out."""
    b = BUDGET.get()
    if b is not None:
        b.text(value)
    return value


def _joined_output(parts: Iterable[str]) -> str:
    """``"".join`` that counts: the template's output, macro and block bodies."""
    b = BUDGET.get()
    if b is None:
        return "".join(parts)
    out: list[str] = []
    n = nbytes = 0
    for part in parts:
        n += len(part)
        nbytes += utf8_bound(part)
        b.chars(n, nbytes)
        out.append(part)
    text = "".join(out)
    b.make(text)
    return text


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # Filters that take the context, eval context or environment get it first.
    first = 2 if hasattr(func, "jinja_pass_arg") else 1

    @functools.wraps(func)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = BUDGET.get()
        if b is None:
            # Jinja folds a filter of constants when it compiles ('x'|center(10**9)):
            # never outside a render's budget; it runs when the template renders.
            raise nodes.Impossible()
        if len(args) >= first:
            b.tick()
            value = check_filter(b, name, args[first - 1], args[first:], kwargs)
            args = (*args[: first - 1], value, *args[first:])
        result = func(*args, **kwargs)
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
        self.qr_iter = iterate
        self.qr_concat = _concat_parts
        self.concat = _joined_output  # type: ignore[method-assign]

    def getattr(self, obj: Any, attribute: str) -> Any:
        b = BUDGET.get()
        if b is not None:
            b.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        b = BUDGET.get()
        if b is not None:
            b.tick()
        result = super().getitem(obj, argument)
        if b is not None and isinstance(argument, slice):
            b.make(result)  # a slice is a copy
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        b = BUDGET.get()
        if b is not None:
            b.tick()
            check_binop(b, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if b is not None:
            b.make(result)
        return result

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        b = BUDGET.get()
        if b is not None:
            b.tick()
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, str) and isinstance(getattr(obj, "__name__", None), str):
                args = check_str_method(b, owner, obj.__name__, args)
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
            b = BUDGET.get()
            if b is not None:
                check_brace(b, fmt, args, kwargs)
            return inner(*args, **kwargs)

        return checked


def _raise(message: object) -> NoReturn:
    raise Refused(str(message)[:_REFUSAL_CHARS])


def _strftime_now(fmt: object) -> str:
    """``datetime.now().strftime(fmt)`` for a short format of plain directives: C's
    strftime runs holding the GIL, and a width (``%999999999Y``) or a long format is
    as long as it says."""
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT:
        raise LimitExceeded("size")
    i = 0
    while (i := fmt.find("%", i)) >= 0:
        i += 1
        if i < len(fmt) and fmt[i] == "-":
            i += 1
        if i >= len(fmt) or fmt[i] not in _STRFTIME_DIRECTIVES:
            raise LimitExceeded("size")
        i += 1
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox (cached: a model's template is
    compiled once)."""
    env = _BoundedSandbox()
    return env.from_string(_Guard().visit(env.parse(source)))


def render_text(
    source: str,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    bos_token: str,
    eos_token: str,
    *,
    timeout_s: float,
    max_chars: int,
    max_bytes: int,
) -> str:
    """Render ``source`` for generation under a budget; raises :class:`LimitExceeded`,
    :class:`Refused`, :class:`Unsafe` or :class:`Failed`."""
    try:
        template = compile_template(source)
    except Exception as exc:  # a template's syntax is the model's
        raise Failed(type(exc).__name__) from exc
    budget = Budget(time.monotonic() + timeout_s, max_chars, max_bytes)
    token = BUDGET.set(budget)
    try:
        return template.render(
            messages=list(messages),
            add_generation_prompt=True,
            tools=tools,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except (Refused, LimitExceeded):
        raise
    except MemoryError:
        raise LimitExceeded("memory") from None
    except RecursionError:
        raise LimitExceeded("depth") from None
    except jinja2.exceptions.SecurityError as exc:
        raise Unsafe(str(exc)) from None
    except Exception as exc:  # template code is the model's: any failure is its failure
        raise Failed(type(exc).__name__) from None
    finally:
        BUDGET.reset(token)

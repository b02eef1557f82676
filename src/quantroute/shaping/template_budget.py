"""The chat template sandbox's budget, and what each operation would build before it does.

Used by :mod:`~quantroute.shaping.template_sandbox` (its hooks read :data:`BUDGET`, set
for one render). Every scan here is one pass, left to right: no regular expressions,
nothing that backtracks on a template's strings.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.utils import Namespace

__all__ = [
    "BUDGET",
    "MAX_FORMAT_SPEC",
    "MAX_INT_BITS",
    "Budget",
    "LimitExceeded",
    "check_binop",
    "check_brace",
    "check_filter",
    "check_str_method",
    "iterate",
    "text_size",
    "utf8_bound",
]

#: The largest integer a template may make (``2 ** 10**10`` would take minutes in C).
MAX_INT_BITS = 1 << 16
#: The longest spec of one ``str.format`` field (``{:>10.3f}``'s is 6 characters).
MAX_FORMAT_SPEC = 32
_MAX_FORMAT_FIELD = 256  # characters of one field, its name included
_MAX_JSON_INDENT = 64
# All the strings and lists a template makes, together, at most this many times
# the limits: each may be under them, a million of them are not.
_MADE_FACTOR = 32
_SLOT_BYTES = 8  # a list's slot: a pointer


class LimitExceeded(Exception):
    """The template went over its budget: ``what`` is ``time``, ``size``, ``memory``
    (its process ran out) or ``depth`` (recursion)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def utf8_bound(s: str) -> int:
    """An upper bound of ``len(s.encode())`` in O(1): exact for ASCII."""
    return len(s) if s.isascii() else 4 * len(s)


# ---- the budget ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Budget:
    deadline: float  # time.monotonic()
    max_chars: int
    max_bytes: int
    made: int = 0  # bytes of every value the template has made so far

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded("time")

    def chars(self, n: int, nbytes: int | None = None) -> None:
        """Refuse a value of ``n`` characters (items) taking ``nbytes`` bytes."""
        if n > self.max_chars or (n if nbytes is None else nbytes) > self.max_bytes:
            raise LimitExceeded("size")

    def string(self, n: int, s: str) -> None:
        """Refuse a string of ``n`` characters as wide as ``s``'s."""
        self.chars(n, n if s.isascii() else 4 * n)

    def text(self, *values: object) -> None:
        """Refuse to turn ``values`` into text over the limits (a list holding one
        string many times is small until ``str()`` spells it out)."""
        self.chars(0, sum(text_size(v, self.max_bytes) for v in values))

    def make(self, value: object) -> None:
        """Account for a value the template made: no one value, nor all of them
        together, may be bigger than the limits allow."""
        if isinstance(value, str):
            size = utf8_bound(value)
            self.chars(len(value), size)
        elif isinstance(value, list | tuple | dict):
            size = _SLOT_BYTES * len(value)
            self.chars(len(value), size)
        else:
            if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
                raise LimitExceeded("size")
            return
        self.made += size
        if self.made > _MADE_FACTOR * min(self.max_chars, self.max_bytes):
            raise LimitExceeded("size")


def text_size(value: object, limit: int) -> int:
    """About how many UTF-8 bytes ``str(value)`` is, counting no further than past ``limit``."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += utf8_bound(v)
        elif isinstance(v, bytes):
            total += 4 * len(v)  # its repr: \xNN
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
BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


# ---- estimates: what one operation would build, before it builds it -----------------------------

# Filters that turn their value into text (the rest move items around).
_TEXT_FILTERS = frozenset(
    {
        "capitalize", "center", "e", "escape", "filesizeformat", "forceescape", "format",
        "indent", "join", "lower", "pprint", "replace", "safe", "string", "striptags", "title",
        "tojson", "trim", "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap",
        "xmlattr",
    }
)  # fmt: skip
_DIGITS = frozenset("0123456789")
_MAX_WIDTH_DIGITS = 12


def _ints(*groups: Iterable[object]) -> Iterator[int]:
    for group in groups:
        for v in group:
            if isinstance(v, int) and not isinstance(v, bool):
                yield abs(v)


def _no_big_ints(b: Budget, *groups: Iterable[object]) -> None:
    """No integer argument may be over the limits (widths, counts, sizes)."""
    if any(v > b.max_chars or v > b.max_bytes for v in _ints(*groups)):
        raise LimitExceeded("size")


def _number(b: Budget, s: str, i: int) -> int:
    """Check the decimal width at ``s[i:]`` (if any); the index past it. Linear."""
    j = i
    while j < len(s) and s[j] in _DIGITS:
        j += 1
    if j > i:
        b.chars(int(s[i:j]) if j - i <= _MAX_WIDTH_DIGITS else b.max_chars + 1)
    return j


def _percent(b: Budget, fmt: str, args: object) -> None:
    """``fmt % args``: every width and precision (or ``*``) checked, one scan of ``fmt``."""
    b.text(fmt, args)
    values = args if isinstance(args, tuple) else (args,)
    i, n = 0, len(fmt)
    while (i := fmt.find("%", i)) >= 0:
        i += 1
        if i < n and fmt[i] == "%":
            i += 1
            continue
        if i < n and fmt[i] == "(":
            close = fmt.find(")", i)
            if close < 0:  # a key without end (Python refuses it): refused as a bound
                raise LimitExceeded("size")
            i = close + 1
        while i < n and fmt[i] in "#0- +":
            i += 1
        for part in (0, 1):
            if part and not (i < n and fmt[i] == "."):
                break
            i += part
            if i < n and fmt[i] == "*":
                _no_big_ints(b, values)
                i += 1
            else:
                i = _number(b, fmt, i)


def check_brace(b: Budget, fmt: str, args: Sequence[object], kwargs: dict[str, Any]) -> None:
    """``fmt.format(...)``: each field's spec short and its width in bounds, a nested
    field's arguments small; a field that does not parse is refused. One scan of ``fmt``."""
    b.text(fmt, *args, *kwargs.values())
    i, n = 0, len(fmt)
    while True:
        opening, closing = fmt.find("{", i), fmt.find("}", i)
        if opening < 0 and closing < 0:
            return
        if opening < 0 or 0 <= closing < opening:  # "}}" outside a field
            i = closing + 2
            continue
        if fmt.startswith("{{", opening):
            i = opening + 2
            continue
        depth, j, spec, nested = 1, opening + 1, -1, False
        end = min(n, opening + _MAX_FORMAT_FIELD)
        while j < end and depth:
            c = fmt[j]
            if c == "{":
                depth, nested = depth + 1, True
                if depth > 2:
                    raise LimitExceeded("size")  # Python: "Max string recursion exceeded"
            elif c == "}":
                depth -= 1
            elif c == ":" and depth == 1 and spec < 0:
                spec = j + 1
            j += 1
        if depth:
            raise LimitExceeded("size")  # unterminated, or longer than a field can be
        if spec >= 0:
            if j - 1 - spec > MAX_FORMAT_SPEC:
                raise LimitExceeded("size")
            k = spec
            while k < j - 1:
                k = _number(b, fmt, k) + 1 if fmt[k] in _DIGITS else k + 1
        if nested:
            _no_big_ints(b, args, kwargs.values())
        i = j


def _replace(b: Budget, s: str, old: object, new: object) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = len(s) + 1 if not old else s.count(old)
        n = len(s) + hits * (len(new) - len(old))
        b.chars(n, n if s.isascii() and new.isascii() else 4 * n)


def _sized(items: Any) -> Any:
    """``items`` as something with a length: a generator is drawn out (with ticks)."""
    return items if hasattr(items, "__len__") else list(iterate(items))


def _joined(b: Budget, sep: object, seq: Any) -> None:
    if isinstance(sep, str) and hasattr(seq, "__len__"):
        b.string(len(seq) * (len(sep) + 1), sep)
        if isinstance(seq, list | tuple):
            b.chars(0, len(seq) * utf8_bound(sep) + text_size(seq, b.max_bytes))


def _int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise LimitExceeded("size")


def check_binop(b: Budget, op: str, left: object, right: object) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str) and isinstance(n, int):
                b.string(len(seq) * max(n, 0), seq)
            elif isinstance(seq, list | tuple) and isinstance(n, int):
                b.chars(len(seq) * max(n, 0), _SLOT_BYTES * len(seq) * max(n, 0))
        if isinstance(left, int) and isinstance(right, int):
            _int_bits(left.bit_length() + right.bit_length())
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _int_bits(left.bit_length() * right)
    elif op == "+":
        if isinstance(left, str) and isinstance(right, str):
            b.chars(len(left) + len(right), utf8_bound(left) + utf8_bound(right))
        elif isinstance(left, list | tuple) and type(left) is type(right):
            b.chars(len(left) + len(right), _SLOT_BYTES * (len(left) + len(right)))
    elif op == "%" and isinstance(left, str):
        _percent(b, left, right)


_PADDING = frozenset({"center", "ljust", "rjust", "zfill"})


def check_str_method(b: Budget, s: str, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Check ``s.name(*args)`` (str methods reach ``call`` as bound builtins); the
    arguments to call it with."""
    _no_big_ints(b, args)
    if name == "replace" and len(args) >= 2:
        _replace(b, s, args[0], args[1])
    elif name in _PADDING and args and isinstance(args[0], int):
        fill = args[1] if len(args) > 1 and isinstance(args[1], str) else " "
        b.string(max(args[0], len(s)), s if not s.isascii() else fill)
    elif name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else 8
        b.string(len(s) + s.count("\t") * max(size, 0), s)
    elif name == "join" and args:
        args = (_sized(args[0]), *args[1:])
        _joined(b, s, args[0])
    elif name in ("translate", "format_map"):
        raise LimitExceeded("size")  # a table can map each character to a string
    return args


def check_filter(
    b: Budget, name: str, value: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """Check ``value|name(*args, **kw)``; the value to call it with."""
    if name in _TEXT_FILTERS:
        if name == "join":
            value = _sized(value)
            _joined(b, args[0] if args else kw.get("d", ""), value)
        b.text(value)
    if name == "tojson":
        indent = args[0] if args else kw.get("indent")
        if isinstance(indent, int) and indent > _MAX_JSON_INDENT:
            raise LimitExceeded("size")
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
        b.string(len(text) + (text.count("\n") + 1) * per_line, text)
        if isinstance(width, str):
            b.chars(0, utf8_bound(text) + (text.count("\n") + 1) * utf8_bound(width))
    elif name == "center":
        width = args[0] if args else kw.get("width", 80)
        if isinstance(width, int):
            b.string(max(width, len(text)), text)
    elif name == "wordwrap":
        width = args[0] if args else kw.get("width", 79)
        wrap = args[2] if len(args) > 2 else kw.get("wrapstring")
        if isinstance(width, int) and isinstance(wrap, str):
            lines = len(text) // max(width, 1) + text.count("\n") + 1
            b.chars(len(text) + lines * len(wrap), utf8_bound(text) + lines * utf8_bound(wrap))
    elif name == "format":
        _percent(b, text, tuple(args) or kw)
    return value


def iterate(iterable: Iterable[Any]) -> Iterator[Any]:
    b = BUDGET.get()
    for item in iterable:
        if b is not None:
            b.tick()
        yield item

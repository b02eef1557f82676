"""A JSON schema's ``pattern``, for the grammar: what it costs, and the JSON text it allows.

:mod:`quantroute.shaping.grammar` hands each ``pattern`` to llama.cpp's schema
converter, which copies a regular expression into GBNF nearly as it is. Two things
happen here first:

- :func:`pattern_size` measures what the pattern costs llama.cpp's sampler (its
  characters spelled out, nested counts multiplied, and how many positions it leaves
  open at once), and refuses what is no regular expression, so that
  :func:`quantroute.shaping.grammar.check_schema` can bound it;
- :func:`pattern_in_json` rewrites it so that the grammar the converter makes is that of
  the *JSON text* of the values it matches: a class's ``"``, ``\\`` and control
  characters become their escapes, a literal ``"`` becomes ``\\"``.

:class:`SchemaError` is defined here, for both modules raise it, and the CPU budget
their checks keep to (:func:`cpu_budget`, :func:`spend`): they run in a thread, which
cannot be stopped from outside, so they look at the clock themselves.
"""

from __future__ import annotations

import array
import math
import re
import string
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

_MAX_PATTERN_ALTERNATIVES = 256  # a pattern's branches: one more than its "|", in all
#: A pattern's characters: every one is read several times over (a class of 260,000 of
#: them held the event loop for two minutes); real patterns are far shorter.
MAX_PATTERN_CHARS = 8192
_CHECK_EVERY = 256  # loop steps between two looks at the clock (each is a system call)
_DEADLINE: ContextVar[float] = ContextVar("quantroute_schema_deadline", default=math.inf)


class SchemaError(ValueError):
    """A schema the grammar cannot enforce; ``str`` says what is wrong and where.

    It quotes nothing the client wrote: a keyword or format is named only when it is one
    of JSON Schema's, a property (or a ``$defs`` entry) by its position among its
    siblings (``schema.properties[2]``, from 0), never by its name, and a value never.
    """


@contextmanager
def cpu_budget(seconds: float) -> Iterator[None]:
    """Within it, :func:`spend` raises once this thread has used ``seconds`` of CPU time.
    CPU time, not wall time: a schema's cost is its own, whatever else the machine does,
    so a refusal for it may be remembered like any other."""
    token = _DEADLINE.set(time.thread_time() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def spend(where: str) -> None:
    """Raise :class:`SchemaError` when this thread's :func:`cpu_budget` is spent (never
    outside one). Loops call it every so many steps."""
    deadline = _DEADLINE.get()
    if deadline != math.inf and time.thread_time() > deadline:
        raise SchemaError(f"{where} takes longer to check than this server allows")


# A pattern's item as the sampler meets it: (characters once expanded, positions it may
# start at, whether it can match nothing, most positions open at once inside it).
_Item = tuple[int, int, bool, int]


def _repeated(item: _Item, least: int, most: int | None) -> _Item:
    size, first, empty, readings = item
    times = max(most if most is not None else least + 1, 1)
    if empty:  # a run of copies that can each match nothing: all of them open at once
        return size * times, first * times, True, readings + first * (times - 1)
    more = first if times > 1 and (most is None or most > least) else 0  # or stop here
    return size * times, first, least == 0, readings + more


def _sequence(items: list[_Item]) -> _Item:
    size = sum(item[0] for item in items)
    first, empty, readings, run = 0, True, 0, 0
    for _, item_first, item_empty, item_readings in items:
        if empty:
            first += item_first
            empty = item_empty
        # open at once: this item's start, from anywhere in the skippable run before it
        readings = max(readings, item_readings, run + item_first)
        run = run + item_first if item_empty else 0
    return size, first, empty, readings


def _alternatives(branches: list[_Item]) -> _Item:
    first = sum(b[1] for b in branches)  # branches may share a beginning: all open
    readings = max(first, *(b[3] for b in branches))
    return sum(b[0] for b in branches), first, any(b[2] for b in branches), readings


def pattern_size(where: str, body: str) -> tuple[int, int]:
    """What the pattern ``body`` (the part between ``^`` and ``$``) costs the sampler, read
    the way the converter reads it: the characters it spells out once every ``{n,m}`` is
    expanded to its largest count (nested counts multiply; ``*``, ``+`` and ``?`` count
    their item once, a group its branches together) and how many positions may be open
    at once (its readings: a run of items that can each match nothing, as in
    ``(a?){256}``, keeps them all open; a class written both raw and escaped in JSON,
    as ``.`` and ``[^a]`` are, counts twice). Refuse a pattern over
    :data:`MAX_PATTERN_CHARS`, more than so many ``|``, what is no regular expression (an
    unbalanced bracket, a quantifier of nothing, ``{n,m}`` with n > m) and a ``|`` outside
    parentheses, which the converter would join to the string's quotes."""
    if len(body) > MAX_PATTERN_CHARS:  # before any work: each step below reads it again
        raise SchemaError(f"{where} may be at most {MAX_PATTERN_CHARS} characters long")
    # per open group: its finished branches, and the items of the branch being read
    groups: list[tuple[list[_Item], list[_Item]]] = [([], [])]
    bars = steps = 0
    i, n = 0, len(body)
    while i < n:
        steps += 1
        if not steps % _CHECK_EVERY:
            spend(where)
        c = body[i]
        branches, items = groups[-1]
        if c in "*+?{":
            if not items:
                raise SchemaError(f"{where}: a quantifier repeats nothing")
            least, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c, (0, 0))
            i += 1
            if c == "{":
                end = body.find("}", i)
                if end < 0:
                    raise SchemaError(f"{where}: a {{ is not closed")
                low, comma, high = body[i:end].partition(",")
                try:
                    least = int(low) if low.strip() or not comma else 0
                    most = int(high) if high.strip() else None if comma else least
                except ValueError:
                    raise SchemaError(f"{where}: a {{...}} is not a repetition count") from None
                if most is not None and most < least:
                    raise SchemaError(f"{where}: a repetition count {{n,m}} has n > m")
                i = end + 1
            items[-1] = _repeated(items[-1], least, most)
            continue
        if c == "(":
            if body.startswith("?", i + 1) and not body.startswith("?:", i + 1):
                raise SchemaError(f"{where}: of the (?...) groups only (?:...) is supported")
            groups.append(([], []))
            i += 3 if body.startswith("?:", i + 1) else 1
            continue
        if c == "|":
            if len(groups) == 1:
                raise SchemaError(f"{where}: a | outside parentheses is not supported: ^(a|b)$")
            bars += 1
            if bars >= _MAX_PATTERN_ALTERNATIVES:  # said before reading on
                raise SchemaError(
                    f"{where} may have at most {_MAX_PATTERN_ALTERNATIVES} alternatives (|)"
                )
            branches.append(_sequence(items))
            items.clear()
            i += 1
            continue
        if c == ")":
            if len(groups) == 1:
                raise SchemaError(f"{where}: a ) closes no (")
            groups.pop()
            groups[-1][1].append(_alternatives([*branches, _sequence(items)]))
            i += 1
            continue
        # a class whose JSON text is raw or escaped opens two ways at once ([^a], ".")
        if c == "[":
            chars, i = _bracket(where, body, i)
            ways = _ways(chars)
        elif c == "\\":
            escaped, i = _escape(where, body, i)
            ways = _ways(_class_escape(escaped, at_most=False)) if isinstance(escaped, str) else 1
        else:
            ways = _ways(_DOT) if c == "." else 1
            i += 1
        items.append((1, ways, False, ways))
    if len(groups) > 1:
        raise SchemaError(f"{where}: a ( is not closed")
    size, _, _, readings = _sequence(groups[0][1])
    return size, max(readings, 1)


# ---- a pattern, as the text of a JSON string ------------------------------------------
#
# A pattern constrains a string's value; the grammar constrains the JSON text that writes
# it, where ", \ and U+0000..U+001F never stand raw. So each character class of a pattern
# (a bracket, ".", "\d") becomes the raw characters of it that JSON allows and the escapes
# of those it must escape ([^a] is ([^a"\\\x00-\x1F] | \\(["\\bfnrt] | u00...)), and a
# literal " becomes \", a newline \n. Every text the grammar allows then decodes to a value
# the pattern matches, read as ECMA-262 reads it (JSON Schema's regular expressions) and as
# Python's re does (jsonschema's): where they differ, a class holds what both agree on.

_Ranges = list[tuple[int, int]]  # code points, inclusive: sorted, apart, not touching
_LAST = 0x10FFFF
_ESCAPED: _Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # never raw in JSON text
_NOT_RAW: _Ranges = [*_ESCAPED, (0xD800, 0xDFFF)]  # nor surrogates, which UTF-8 cannot hold
# JSON's short escapes (\" \\ \b \f \n \r \t), as GBNF class members after the backslash;
# the other control characters are written \u00XX
_SHORT_ESCAPES = {
    0x22: "\\x22",
    0x5C: "\\x5C",
    0x08: "b",
    0x0C: "f",
    0x0A: "n",
    0x0D: "r",
    0x09: "t",
}
_CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D}  # a pattern's \t...
_CONVERTER_SYNTAX = frozenset('|.()[]{}*+?^$\\"')  # what the converter would not copy as is
# "." holds neither line break, nor U+2028/U+2029 (ECMA-262's line terminators)
_DOT: _Ranges = [(0x00, 0x09), (0x0B, 0x0C), (0x0E, 0x2027), (0x202A, _LAST)]
_WORD: _Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# \s: the white space both ECMA-262 and Python's str.isspace hold; the one either holds
_SPACE_BOTH: _Ranges = [
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
]  # fmt: skip
_SPACE_EITHER: _Ranges = [
    (0x09, 0x0D), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
    (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
    (0x3000, 0x3000), (0xFEFF, 0xFEFF),
]  # fmt: skip


def _normal(ranges: Iterable[tuple[int, int]]) -> _Ranges:
    out: _Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: _Ranges) -> _Ranges:
    out: _Ranges = []
    start = 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _LAST:
        out.append((start, _LAST))
    return out


def _minus(ranges: _Ranges, less: _Ranges) -> _Ranges:
    return _complement(_normal([*_complement(ranges), *less]))


def warm() -> None:
    """Build the tables a first pattern would otherwise build where it is converted, on
    the event loop: Python's decimal digits take ~50 ms (every code point scanned once).
    The app's lifespan calls it in a thread before it serves."""
    _decimals()


@cache
def _decimals() -> _Ranges:
    """The characters Python's ``\\d`` matches (Unicode's decimal digits): ECMA-262's
    ``\\d`` is 0-9 alone, so only a character outside these is a ``\\D`` in both."""
    codes = array.array("I", range(_LAST + 1))  # every code point in one str, built fast
    every = codes.tobytes().decode(f"utf-32-{sys.byteorder[0]}e", "surrogatepass")
    return [(ord(m.group()[0]), ord(m.group()[-1])) for m in re.finditer(r"\d+", every)]


def _class_escape(letter: str, *, at_most: bool) -> _Ranges:
    """What ``\\d``, ``\\w``, ``\\s`` (``letter``) or a negation holds: at least (where a
    class holds it) or, ``at_most``, at most (in a negated bracket, which holds what it
    does not). Python's ``\\w`` holds letters and digits past ASCII too, so ``\\W`` and
    ``[^\\w]`` keep to ASCII."""
    if letter.isupper():  # \D holds at least what \d holds not even at most, and so on
        return _complement(_class_escape(letter.lower(), at_most=not at_most))
    if letter == "d":
        return _decimals() if at_most else [(0x30, 0x39)]
    if letter == "w":
        return _normal([*_WORD, (0x80, _LAST)]) if at_most else _WORD
    return _SPACE_EITHER if at_most else _SPACE_BOTH


def _escape(where: str, text: str, i: int) -> tuple[int | str, int]:
    """The escape at ``text[i]`` (a backslash), and where it ends: a code point, or the
    letter of a class (``d w s D W S``). Any other escape (``\\b``, ``\\1``, ``\\p``) is a
    :class:`SchemaError`."""
    e = text[i + 1 : i + 2]
    if e and e in "dwsDWS":
        return e, i + 2
    if e in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[e], i + 2
    digits = {"u": 4, "x": 2}.get(e, 0)
    code = text[i + 2 : i + 2 + digits]
    if digits and len(code) == digits and all(h in string.hexdigits for h in code):
        if 0xD800 <= int(code, 16) <= 0xDFFF:  # half a character: no UTF-8 text holds it
            raise SchemaError(f"{where}: a \\u escape of a surrogate is not supported")
        return int(code, 16), i + 2 + digits
    if len(e) == 1 and e.isascii() and not e.isalnum() and e != "_":
        return ord(e), i + 2
    raise SchemaError(f"{where}: an escape this server does not support (\\b, \\1...)")


def _bracket(where: str, text: str, i: int) -> tuple[_Ranges, int]:
    """The characters the bracket expression at ``text[i]`` (a ``[``) holds, and where it
    ends: its members' (``a``, ``a-z``, ``\\d``, ``\\x41``...), or, negated, all others."""
    i += 1
    negated = text.startswith("^", i)
    i += negated
    held: _Ranges = []
    letters: set[str] = set()  # class escapes seen: a negated \d adds 60-odd ranges, once
    while i < len(text) and text[i] != "]":
        first, i = _escape(where, text, i) if text[i] == "\\" else (ord(text[i]), i + 1)
        if text.startswith("-", i) and text[i + 1 : i + 2] not in ("", "]"):
            last, i = (
                _escape(where, text, i + 1) if text[i + 1] == "\\" else (ord(text[i + 1]), i + 2)
            )
            if isinstance(first, str) or isinstance(last, str) or first > last:
                raise SchemaError(f"{where}: a range (a-z) needs two characters, in order")
            held.append((first, last))
        elif isinstance(first, str):
            if first not in letters:
                letters.add(first)
                held += _class_escape(first, at_most=negated)
        else:
            held.append((first, first))
    if i >= len(text):
        raise SchemaError(f"{where}: a [ is not closed")
    if not held:
        raise SchemaError(f"{where}: an empty [] is not supported")
    return _complement(_normal(held)) if negated else _normal(held), i + 1


def _member(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    return (
        f"\\x{code:02X}"
        if code < 0x100
        else f"\\u{code:04X}"
        if code < 0x10000
        else f"\\U{code:08X}"
    )


def _class(ranges: _Ranges) -> str:
    """``ranges`` as a GBNF class, negated where that is shorter (``[^a...]``)."""
    others = _complement(ranges)
    members = others if len(others) < len(ranges) else ranges
    text = "".join(_member(lo) + (f"-{_member(hi)}" if hi > lo else "") for lo, hi in members)
    return f"[^{text}]" if members is others else f"[{text}]"


def _escapes(codes: list[int]) -> str:
    """The JSON escapes of ``codes`` (", \\ and control characters), as a pattern the
    converter copies: a backslash, then a short escape's letter or ``u00`` and hex digits
    (either case)."""
    short = "".join(_SHORT_ESCAPES[c] for c in codes if c in _SHORT_ESCAPES)
    lows: dict[int, str] = {}  # \u00XY: for each X, the Ys (a-f in either case)
    for c in codes:
        if c not in _SHORT_ESCAPES:
            low = f"{c & 15:x}"
            lows[c >> 4] = lows.get(c >> 4, "") + (low if low.isdigit() else low + low.upper())
    after = [f"[{short}]"] if short else []
    if lows:
        coded = [f"{high}[{digits}]" for high, digits in sorted(lows.items())]
        after.append("u00" + (coded[0] if len(coded) == 1 else f"({'|'.join(coded)})"))
    return "\\\\" + (after[0] if len(after) == 1 else f"({'|'.join(after)})")


def _encoded(where: str, chars: _Ranges) -> str:
    """A class holding ``chars`` (a value's characters), as a pattern the converter turns
    into the GBNF of their JSON text: those JSON allows raw, or the escapes of the rest."""
    raw = _minus(chars, _NOT_RAW)
    escaped = _minus(chars, _complement(_ESCAPED))
    codes = [c for lo, hi in escaped for c in range(lo, hi + 1)]
    if not raw and not codes:
        raise SchemaError(f"{where}: a class that holds no character")
    if not codes:
        return _class(raw)
    return f"({_class(raw)}|{_escapes(codes)})" if raw else f"({_escapes(codes)})"


def _ways(chars: _Ranges) -> int:
    """The alternatives :func:`_encoded` opens at once for ``chars``: 2 where they are
    written both raw and escaped, as ``[^a]`` is (llama.cpp's sampler keeps a stack for
    each), else 1."""
    raw, escaped = _minus(chars, _NOT_RAW), _minus(chars, _complement(_ESCAPED))
    return 2 if raw and escaped else 1


def _literal(code: int) -> str:
    c = chr(code)
    if any(lo <= code <= hi for lo, hi in _ESCAPED):
        return f"({_escapes([code])})"
    return f"[{_member(code)}]" if c in _CONVERTER_SYNTAX else c


def pattern_in_json(where: str, pattern: str) -> str:
    """``pattern`` (anchored, its syntax checked by :func:`pattern_size`) rewritten for
    the converter, which copies brackets and escapes as they are, so that the grammar it
    makes is that of the JSON text of each value the pattern matches, or of some of them:
    each class (a bracket, ``.``, ``\\d`` ...) becomes its raw characters and escapes, a
    literal JSON escapes its escape, ``(?:`` a group; ``\\t``, ``\\n``, ``\\r``, ``\\f``,
    ``\\v``, ``\\xXX``, ``\\uXXXX`` and escaped punctuation are characters. Another escape
    (``\\b``, a backreference), a ``^`` or ``$`` inside, a class that holds no character
    (``[^\\s\\S]``) are a :class:`SchemaError`."""
    body = pattern[1:-1]
    out: list[str] = []
    i = steps = 0
    while i < len(body):
        steps += 1
        if not steps % _CHECK_EVERY:
            spend(where)
        c = body[i]
        if c == "[":
            chars, i = _bracket(where, body, i)
            out.append(_encoded(where, chars))
        elif c == "\\":
            escaped, i = _escape(where, body, i)
            if isinstance(escaped, str):
                out.append(_encoded(where, _class_escape(escaped, at_most=False)))
            else:
                out.append(_literal(escaped))
        elif c == "{":  # a count: its syntax is checked
            end = body.find("}", i)
            if end < 0:
                raise SchemaError(f"{where}: a {{ is not closed")
            out.append(body[i : end + 1])
            i = end + 1
        elif c in "^$":
            raise SchemaError(f"{where}: ^ and $ are supported only at its ends")
        else:
            if c == "(" and body.startswith("?:", i + 1):
                i += 2  # a group that captures nothing is a group
            out.append(
                _encoded(where, _DOT) if c == "." else c if c in "()|*+?" else _literal(ord(c))
            )
            i += 1
    return "^" + "".join(out) + "$"

"""No regular expression in ``src/`` repeats something that itself repeats.

A pattern such as ``(a+)*`` or ``(?:x*y)*`` gives Python's backtracking engine many
ways to read one text, and it tries them all before it fails: a body of
``[`` x 70, ``"``, then ``\\"`` repeated stalled the event loop for 4 s at 40 KB
through the nesting check's string pattern (issue #32, H1). This test reads every
pattern the code compiles or matches with (``re.*`` calls, pydantic's ``pattern=``)
and fails on any repetition (a ``*``, ``+`` or ``{n,m}`` with m > 1) whose item holds
another quantifier. An optional group (``(\\.\\d+)?``) repeats nothing: it is allowed.

A pattern that is not a literal is read from the compiled object its module keeps;
one that is neither (a pattern built per call) is a failure too: it cannot be checked.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
_MATCHERS = {
    "compile",
    "search",
    "match",
    "fullmatch",
    "sub",
    "subn",
    "findall",
    "finditer",
    "split",
}
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)

#: (file, pattern) -> why no client's text ever reaches it. Keep it short.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "quantroute/config/telemetry.py",
        r"^(auto|(nvml|nvidia-smi|cpu|sim:[^+\s]+)(\+(nvml|nvidia-smi|cpu|sim:[^+\s]+))*)$",
    ): "telemetry.devices: the operator's setting, read once at start-up, never a request's; "
    "and each repetition starts with a '+' that the item before it cannot hold, so there is "
    "one way to read any text",
}


def nested(pattern: str | bytes) -> bool:
    """Whether ``pattern`` has a repetition (at most more than once) holding a quantifier.

    >>> nested(r"(a+)*"), nested(r"(?:x*y)*"), nested(r"-?\\d+(?:\\.\\d+)?"), nested(r"a{2,}b*")
    (True, True, False, False)
    """

    def inner(op: Any, av: Any) -> list[Any]:
        """The parts of one parsed item that hold items of their own."""
        if op is sre.BRANCH:
            return list(av[1])
        if op is sre.SUBPATTERN:
            return [av[-1]]
        if op in (sre.ASSERT, sre.ASSERT_NOT):
            return [av[1]]
        if op is sre.ATOMIC_GROUP:  # it gives nothing back once matched; inside, it may
            return [av]
        if op is sre.GROUPREF_EXISTS:
            return [b for b in av[1:] if b is not None]
        return []

    def walk(items: Any, repeating: bool) -> bool:
        for op, av in items:
            if op in _REPEATS:
                _, most, body = av
                if repeating or walk(body, most is sre.MAXREPEAT or most > 1):
                    return True
            elif any(walk(part, repeating) for part in inner(op, av)):
                return True
        return False

    return walk(sre_parse.parse(pattern), False)


def _patterns() -> Iterator[tuple[str, int, str | bytes | None, str]]:
    """Every pattern in ``src/``: (file, line, pattern or None when unreadable, how)."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        module = rel.removesuffix(".py").replace("/", ".")
        assigned = {
            id(node.value): node.targets[0].id
            for node in tree.body
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "re":
                yield rel, node.lineno, None, "from re import ...: call re.<function> instead"
            if isinstance(node, ast.Import) and any(
                a.name == "re" and a.asname for a in node.names
            ):
                yield rel, node.lineno, None, "import re as ...: import re"
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "re"
                and func.attr in _MATCHERS
            ):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str | bytes):
                    yield rel, node.lineno, arg.value, f"re.{func.attr}"
                elif func.attr == "compile" and id(node) in assigned:
                    name = assigned[id(node)]
                    compiled = getattr(importlib.import_module(module), name)
                    yield rel, node.lineno, compiled.pattern, f"{name} = re.compile"
                else:
                    yield rel, node.lineno, None, f"re.{func.attr} of a pattern built per call"
            for kw in node.keywords:
                if kw.arg == "pattern" and isinstance(func, ast.Name) and func.id == "Field":
                    if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                        yield rel, node.lineno, kw.value.value, "Field(pattern=)"
                    else:
                        yield rel, node.lineno, None, "Field(pattern=) not a literal"


def test_no_pattern_in_src_nests_quantifiers() -> None:
    found = list(_patterns())
    assert len(found) > 20  # the scan sees the code's patterns (a broken scan sees none)
    bad = []
    for rel, line, pattern, how in found:
        if pattern is None:
            bad.append(f"{rel}:{line}: {how}")
        elif nested(pattern) and (rel, pattern) not in ALLOWED:
            bad.append(f"{rel}:{line}: {how} {pattern!r} nests quantifiers")
    assert not bad, "\n".join(bad)


def test_every_allowed_pattern_is_still_there() -> None:
    """An entry whose pattern went is removed with it: the list stays as short as it can."""
    seen = {(rel, p) for rel, _, p, _ in _patterns() if p is not None}
    assert set(ALLOWED) <= seen


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"(a+)*", True),
        (r"(?:x*y)*", True),
        (r'"[^"\\]*(?:\\.[^"\\]*)*"', True),  # the nesting check's string pattern (H1)
        (rb'"[^"\\]*(?:\\.[^"\\]*)*"', True),
        (r"(a|b+)+", True),
        (r"(?:ab{1,3}){2}", True),
        (r"(?>(a+)*)", True),
        (r"(?=(a+)+)", True),
        (r"(?:\.\d+)?", False),
        (r"[0-9]{1,9}", False),
        (r"\{(\d+)(?:,(\d*))?\}", False),
        (r"^[a-zA-Z0-9_-]+$", False),
        (r"(?:ab)*c+", False),
    ],
)
def test_nested_is_read_from_the_parsed_pattern(pattern: str | bytes, expected: bool) -> None:
    assert nested(pattern) is expected
    re.compile(pattern)  # each example is a real pattern

"""The body's nesting check is linear (issue #32, H1).

Its string pattern backtracked quadratically on an unterminated string: ``[`` x 70, a
``"``, then ``\\"`` repeated, held the event loop 4.2 s at 40 KB (18.9 s at 80 KB) on
every generation endpoint, for anyone who could reach them. Now the check is a few
passes in C whatever the body: timed here alone, on a real server while ``/healthz``
is timed, and checked against a plain reading of the parsed value.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from api.sec_loop_probe import healthz_timed
from qrtest import fake_app, live
from quantroute.api.schemas import MAX_JSON_DEPTH, _too_deep

JSON = {"content-type": "application/json"}
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/route/explain")


def _hostile(size: int, escape: bytes = b'\\"') -> bytes:
    """The review's body: nested past the bound, then a string that never ends."""
    head = b"[" * 70 + b'"'
    return head + escape * ((size - len(head)) // len(escape))


def _best_ms(raw: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        assert _too_deep(raw, MAX_JSON_DEPTH)
        best = min(best, (time.perf_counter() - start) * 1000)
    return best


def test_the_reviews_bodies_are_checked_in_milliseconds() -> None:
    """40 KB took 4.2 s, 80 KB 18.9 s; now a few passes over the bytes in C (on an idle
    2-core VM: well under 1 ms at 80 KB, 10-25 ms at 1 MiB; the bounds leave room for a
    loaded machine, and a quadratic check misses them by orders of magnitude)."""
    for size, bound_ms in ((40_000, 20), (80_000, 20), (1 << 20, 250)):
        for escape in (b'\\"', b"\\\\", b'\\"\\\\x'):
            ms = _best_ms(_hostile(size, escape))
            assert ms < bound_ms, f"{size} bytes of {escape!r}: {ms:.1f} ms"
    brackets = b"[" + b"[]," * 300_000 + b"[[[" * 30  # many brackets, all outside strings
    assert _best_ms(brackets) < 250


def _depth(value: Any) -> int:
    """How deep ``value`` nests, iteratively (the reference for ``_too_deep``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list | dict):
            deepest = max(deepest, depth)
            stack += [
                (child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
            ]
    return deepest


_TRICKY = st.text(alphabet='[]{}"\\/ab\n\u00e9', max_size=8)  # what strings may hide brackets in
_VALUES = st.recursive(
    st.none() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, limit=st.integers(0, 6), ascii_only=st.booleans())
def test_the_check_reads_depth_as_the_parsed_value_has_it(
    value: Any, limit: int, ascii_only: bool
) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert _too_deep(raw, limit) == (_depth(value) > limit)


def test_the_doctests_cases() -> None:
    assert not _too_deep(b'{"a": [1, {"b": "[[[[[[\\\\"}]}', 3)  # an escaped backslash ends it
    assert not _too_deep(b'["\\"[[[[", "x"]', 3)  # an escaped quote does not
    assert _too_deep(b'[[["\\\\"[]]]', 3)
    assert _too_deep(b"[[[[]]]]", 3) and _too_deep(b"[[[[", 3)


async def test_healthz_stays_fast_while_the_reviews_bodies_arrive() -> None:
    """On a real server, ``/healthz`` timed from another thread (``sec_loop_probe``)."""
    async with (
        live(fake_app()) as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http,
    ):
        answers = []
        async with healthz_timed(port) as health:
            await asyncio.sleep(0.1)
            for size in (40_000, 80_000, 1_000_000):  # the last just under the 1 MiB limit
                for path in PATHS:
                    start = time.perf_counter()
                    r = await http.post(path, content=_hostile(size), headers=JSON)
                    answers.append((r.status_code, time.perf_counter() - start))
                    assert "nested deeper" in r.json()["error"]["message"]
            await asyncio.sleep(0.1)
    assert all(status == 400 for status, _ in answers)
    assert max(s for _, s in answers) < 0.5, answers
    assert len(health) >= 5 and max(health) < 0.5, max(health)

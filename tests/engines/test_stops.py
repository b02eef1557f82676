from __future__ import annotations

import pytest

from quantroute.engines.stops import StopMatcher


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "stopped"),
    [
        ((), ["ab", "c"], "abc", False),
        (("\n\n",), ["a\n", "\nb"], "a", True),
        (("END",), ["xE", "N", "D", "more"], "x", True),
        (("END",), ["xE", "N", "o"], "xENo", False),  # a near miss is released
        (("ab", "b"), ["xb"], "x", True),  # the earliest stop wins
        (("abc",), ["a", "b", "x", "abc"], "abx", True),
        (("<|end|>",), ["hello <|e", "nd|> tail"], "hello ", True),
        (("aa",), ["a", "a"], "", True),
    ],
)
def test_stop_matcher(
    stops: tuple[str, ...], pieces: list[str], emitted: str, stopped: bool
) -> None:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == emitted
    assert m.stopped is stopped


def test_held_text_is_released_only_when_it_cannot_stop() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("go ST") == "go "
    assert m.feed("O") == ""
    assert m.feed("Px") == ""
    assert m.stopped


def test_flush_releases_a_partial_stop_at_the_end() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("end ST") == "end "
    assert m.flush() == "ST"

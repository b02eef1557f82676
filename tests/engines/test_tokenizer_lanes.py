"""The worker's prompt tokenizer: a long prompt has a thread of its own, so the short
prompts that arrive after it are not held behind it. A tokenizer that blocks on long
text stands in for llama.cpp's (slow on long runs of one character); the real worker's
case is in test_llamacpp_engine.py."""

from __future__ import annotations

import threading
import time

import pytest

from quantroute.engines.llamacpp.tokenizer import LONG_CHARS, Pending, PromptTokenizer


def _wait(pending: Pending, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pending.done and time.monotonic() < deadline:
        time.sleep(0.001)
    return pending.done


def test_short_prompts_are_tokenized_while_a_long_one_is_still_being_tokenized() -> None:
    release = threading.Event()
    order: list[str] = []
    wakes: list[int] = []

    def tokenize(text: str, special: bool) -> list[int]:
        if len(text) >= LONG_CHARS:
            assert release.wait(10)  # slow, until the test says
        order.append(text[:5])
        return [len(text), int(special)]

    prompts = PromptTokenizer(tokenize, lambda: wakes.append(1))
    slow = prompts.submit("\x7f" * LONG_CHARS, False)
    shorts = [prompts.submit(f"p{i}" + "x" * (98 + i), True) for i in range(3)]
    for pending in shorts:
        assert _wait(pending)  # one thread for every prompt would hold these behind slow
    assert not slow.done
    assert [p.result() for p in shorts] == [[100, 1], [101, 1], [102, 1]]
    assert order == ["p0xxx", "p1xxx", "p2xxx"]  # a lane keeps the order they came in
    release.set()
    assert _wait(slow) and slow.result() == [LONG_CHARS, 0]
    assert len(wakes) == 4  # the loop is woken once per prompt
    assert slow.text == "" and all(p.text == "" for p in shorts)  # the text is let go


def test_a_long_prompt_waits_only_for_the_long_ones_before_it() -> None:
    release = threading.Event()

    def tokenize(text: str, special: bool) -> list[int]:
        if text.startswith("first"):
            assert release.wait(10)
        return [len(text)]

    prompts = PromptTokenizer(tokenize, lambda: None, long_chars=10)
    first, second = prompts.submit("first long one", False), prompts.submit("second long", False)
    short = prompts.submit("short", False)
    assert _wait(short) and short.result() == [5]
    time.sleep(0.05)
    assert not first.done and not second.done  # the long lane keeps its order
    release.set()
    assert _wait(second) and first.done and first.result() == [14]


def test_a_cancelled_prompt_is_skipped_and_an_error_is_its_own() -> None:
    def tokenize(text: str, special: bool) -> list[int]:
        if text == "bad":
            raise ValueError("a lone surrogate")
        return [1]

    prompts = PromptTokenizer(tokenize, lambda: None)
    gate = threading.Event()
    blocker = PromptTokenizer(lambda t, s: [int(gate.wait(10))], lambda: None)
    held = blocker.submit("a", False)
    cancelled = blocker.submit("b", False)
    cancelled.cancelled = True
    gate.set()
    assert _wait(held) and _wait(cancelled) and cancelled.tokens == []
    bad, good = prompts.submit("bad", False), prompts.submit("good", False)
    assert _wait(bad) and _wait(good)
    assert good.result() == [1]
    with pytest.raises(ValueError, match="surrogate"):
        bad.result()  # raised on the loop, for its command alone

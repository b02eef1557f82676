"""A worker's prompts, tokenized on a thread of their own, off its decode loop.

llama.cpp's tokenizer takes time in proportion to a prompt's length, and more on
some inputs (long runs of one character are quadratic). Tokenized on the decode
loop, a long prompt held every sequence of the worker for as long as it took: no
token went out to anyone. llama-server tokenizes on its HTTP threads for the same
reason. Here the worker's reader thread hands each prompt to :class:`PromptTokenizer`
as its command arrives; the decode loop admits the command once its tokens are
ready, and steps the other sequences meanwhile.

Prompts of ``LONG_CHARS`` characters or more go to a second thread of their own,
so a long or slow prompt (a megabyte of one character takes llama.cpp 100 s) does
not hold the admission of the short ones that arrive after it; each lane keeps its
prompts in the order they came.

``llama_tokenize`` reads only the vocabulary, which nothing writes after the model
loads, so it runs beside ``llama_decode`` and beside itself (llama-server tokenizes
on several HTTP threads at once); ctypes releases the GIL for the call, so
the loop's Python runs too.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Pending:
    """One prompt: ``done`` once the tokenizer has its ``tokens`` (or its ``error``);
    ``cancelled`` by the loop when its command went, so it is skipped if not begun."""

    __slots__ = ("cancelled", "done", "error", "special", "text", "tokens")

    def __init__(self, text: str, special: bool):
        self.text = text
        self.special = special
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.done = False
        self.cancelled = False

    def result(self) -> list[int]:
        """The tokens; raises what tokenizing raised (a lone surrogate's ``ValueError``)."""
        assert self.done
        if self.error is not None:
            raise self.error
        return self.tokens


# At most about 11 ms of llama.cpp's tokenizer on its worst input (a run of one character;
# 30 KB of one takes 0.04 s) and a few ms on text: what a short prompt may wait behind.
LONG_CHARS = 16_384


class PromptTokenizer:
    """Two threads, one for prompts shorter than ``long_chars`` and one for the rest,
    each tokenizing its prompts in the order they are submitted and calling ``wake``
    after each, so a loop blocked on its commands looks again."""

    def __init__(
        self,
        tokenize: Callable[[str, bool], list[int]],
        wake: Callable[[], None],
        long_chars: int = LONG_CHARS,
    ):
        self._tokenize = tokenize
        self._wake = wake
        self._long_chars = long_chars
        self._short: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._long: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        for lane, name in ((self._short, "tokenizer"), (self._long, "tokenizer-long")):
            threading.Thread(target=self._run, args=(lane,), name=name, daemon=True).start()

    def submit(self, text: str, special: bool) -> Pending:
        pending = Pending(text, special)
        (self._long if len(text) >= self._long_chars else self._short).put(pending)
        return pending

    def _run(self, lane: queue.SimpleQueue[Pending]) -> None:
        while True:
            pending = lane.get()
            try:
                if not pending.cancelled:
                    pending.tokens = self._tokenize(pending.text, pending.special)
            except Exception as exc:  # the command fails alone, on the loop, as before
                pending.error = exc
            pending.text = ""  # the loop needs only the tokens now
            pending.done = True
            self._wake()

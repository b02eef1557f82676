"""A worker's prompts, tokenized on a thread of their own, off its decode loop.

llama.cpp's tokenizer takes time in proportion to a prompt's length, and more on
some inputs (long runs of one character are quadratic). Tokenized on the decode
loop, a long prompt held every sequence of the worker for as long as it took: no
token went out to anyone. llama-server tokenizes on its HTTP threads for the same
reason. Here the worker's reader thread hands each prompt to :class:`PromptTokenizer`
as its command arrives; the decode loop admits the command once its tokens are
ready, and steps the other sequences meanwhile.

``llama_tokenize`` reads only the vocabulary, which nothing writes after the model
loads, so it runs beside ``llama_decode``; ctypes releases the GIL for the call, so
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


class PromptTokenizer:
    """One thread that tokenizes prompts in the order they are submitted and calls
    ``wake`` after each, so a loop blocked on its commands looks again."""

    def __init__(self, tokenize: Callable[[str, bool], list[int]], wake: Callable[[], None]):
        self._tokenize = tokenize
        self._wake = wake
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tokenizer", daemon=True)
        self._thread.start()

    def submit(self, text: str, special: bool) -> Pending:
        pending = Pending(text, special)
        self._queue.put(pending)
        return pending

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if not pending.cancelled:
                    pending.tokens = self._tokenize(pending.text, pending.special)
            except Exception as exc:  # the command fails alone, on the loop, as before
                pending.error = exc
            pending.text = ""  # the loop needs only the tokens now
            pending.done = True
            self._wake()

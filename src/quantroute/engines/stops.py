"""Stop sequences over a stream of text pieces.

Text that could still turn into a stop sequence is held back; it is released
once it cannot, and dropped once it does. Pure and table-tested.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopMatcher:
    """Feed text pieces; get back what may be emitted now.

    >>> m = StopMatcher(("\\n\\n",))
    >>> m.feed("a\\n"), m.feed("\\nb"), m.stopped
    ('a', '', True)
    """

    stops: tuple[str, ...]
    _held: str = ""
    stopped: bool = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stops:
            self._held = ""
            return text
        first = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self._held = ""
            return text[:first]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            best = partial_suffix(text, stop, longer_than=best)
        return best


def partial_suffix(text: str, marker: str, *, longer_than: int = 0) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (text that may yet
    become it, so is held back); ``longer_than`` when there is none longer."""
    for n in range(min(len(marker) - 1, len(text)), longer_than, -1):
        if text.endswith(marker[:n]):
            return n
    return longer_than

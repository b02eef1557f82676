"""What a llama.cpp worker sends (worker process): its events, encoded by :mod:`.wire`,
gathered per decode step and written with one ``write``.

A step's plain tokens go out together: one ``toks`` line carries every sequence's new
token, in batch order; any other event (a ``tok`` with logprobs, a ``start``, a
``fin``) first ends the ``toks`` line gathered so far, so a sequence's events keep
their order and a step may write several lines.

No line is longer than ``max_event_bytes``: an event that would be is replaced by an
``err`` (code ``event_too_large``) for its id, whose later events are dropped
(:attr:`Outbox.refused`: the worker forgets those requests at the step's end).
"""

from __future__ import annotations

import logging
from typing import IO

from quantroute.engines.llamacpp import wire

log = logging.getLogger("quantroute.worker")


class Outbox:
    """The event lines of one step, until :meth:`flush` writes them to ``out``."""

    def __init__(self, out: IO[bytes], max_event_bytes: int):
        self._out = out
        self._lines: list[bytes] = []
        self._tokens: list[tuple[str, str, int]] = []  # this step's plain tokens
        self.max_event_bytes = max_event_bytes
        self.refused: set[str] = set()  # ids whose event was too long: dropped at step end

    def token(self, rid: str, text: str, token: int) -> None:
        """Queue a plain token (no logprobs): this step's go out together, one ``toks``."""
        if rid not in self.refused:
            self._tokens.append((rid, text, token))

    def emit(self, event: wire.Event) -> None:
        """Queue one event line; one over the line limit becomes an ``err`` for its id."""
        if self._tokens:  # they came first
            self._emit_tokens()
        rid: str | None = getattr(event, "id", None)
        if rid in self.refused:
            return
        line = wire.encode(event)
        if len(line) > self.max_event_bytes:
            tag = type(event).__struct_config__.tag
            log.error(
                "worker: a %r event of %d bytes is over the %d-byte line limit; its request fails",
                tag,
                len(line),
                self.max_event_bytes,
            )
            words = (
                f"the worker's {tag!r} event ({len(line)} bytes) is over its "
                f"{self.max_event_bytes}-byte line limit"
            )
            line = wire.encode(wire.Error(rid or "", "event_too_large", words))
            if rid:
                self.refused.add(rid)
        self._lines.append(line)

    def _emit_tokens(self) -> None:
        tokens, self._tokens = self._tokens, []
        line = wire.encode(wire.Tokens(tokens))
        if len(line) <= self.max_event_bytes:
            self._lines.append(line)
            return
        for rid, text, token in tokens:  # too long together: one line each, each checked
            self.emit(wire.Token(rid, text, token))

    def flush(self) -> None:
        """Write what the step gathered, at once."""
        if self._tokens:
            self._emit_tokens()
        if self._lines:
            self._out.write(b"".join(self._lines))
            self._out.flush()
            self._lines.clear()

    def write_raw(self, data: bytes) -> None:
        """Write bytes that are not an event, now (the ``oversize-line`` fault)."""
        self._out.write(data)
        self._out.flush()

    def close(self) -> None:
        """Close the output (the ``hang-up-at-decode`` fault)."""
        self._out.close()

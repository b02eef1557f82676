"""Server-sent events from an upstream, bounded: :class:`EventSplitter` turns the bytes
of a streamed response into the ``data`` of each event, as they come.

An upstream chooses how big its events are; the splitter holds at most ``max_bytes``
of one event and raises :class:`EventTooLarge` past it, so a hostile or broken server
costs the gateway a bounded amount of memory. Only ``data:`` fields matter to an
OpenAI stream (``event:``, ``id:``, ``retry:`` and comments are skipped); the lines of
one event's data are joined with ``\\n`` as the SSE specification says.

>>> s = EventSplitter(1024)
>>> s.feed(b'data: {"a": 1}\\n\\ndata: [DO')
[b'{"a": 1}']
>>> s.feed(b'NE]\\n\\n')
[b'[DONE]']
"""

from __future__ import annotations

__all__ = ["EventSplitter", "EventTooLarge"]


class EventTooLarge(ValueError):
    """An event (or a line of one) is over the splitter's bound."""


class EventSplitter:
    """Incremental SSE parsing: feed chunks, get complete events' data."""

    __slots__ = ("_buffer", "_data", "_max_bytes", "_size")

    def __init__(self, max_bytes: int):
        self._max_bytes = max_bytes
        self._buffer = b""  # an incomplete line
        self._data: list[bytes] = []  # the data lines of the event so far
        self._size = 0  # their bytes, each with the newline that joins it

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event ``chunk`` completes, in order."""
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = buffer[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # a blank line ends the event
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data, self._size = [], 0
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                value = value[1:] if value.startswith(b" ") else value
                self._data.append(value)
                self._size += len(value) + 1  # O(1) a line; an empty line counts too
                if self._size - 1 > self._max_bytes:  # the joined event: one newline fewer
                    raise EventTooLarge(f"an event is over {self._max_bytes} bytes")
        self._buffer = buffer[start:]
        if len(self._buffer) > self._max_bytes:
            raise EventTooLarge(f"a line is over {self._max_bytes} bytes")
        return events

    def close(self) -> list[bytes]:
        """The last event, if the stream ended without its blank line."""
        if self._buffer.startswith(b"data:"):
            value = self._buffer[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        self._buffer = b""
        out = [b"\n".join(self._data)] if self._data else []
        self._data, self._size = [], 0
        return out

"""A response's body chunks written straight to its connection, by whichever task has them.

A streamed token would otherwise pass a task wake on its way out: the engine's
reader appends it to the stream store, which wakes the response's task, which
frames it and awaits the ASGI ``send`` through every middleware down to the
server's transport. :class:`DirectBody` lets the task that has the event (the
engine's reader, for a llama.cpp stream) write the chunk itself, framed as the
server frames it, while the response's task sleeps: a token costs one socket
write and no task switch (docs/benchmarks.md, "Tokens written where they are
read").

It is an ASGI *extension*, as ASGI's own ``http.response.zerocopysend`` and
``http.response.pathsend`` are: :class:`quantroute.api.app.HeadWithBody`, the
outermost layer, which holds the server's ``send``, offers one per request in
``scope["extensions"][EXTENSION]``. **A middleware that reads or changes response
bodies must remove it from the scope it passes on**, as it would those; none of
quantroute's middlewares does either (a test lists them). The response uses it
for the events after its first body only (the head goes out with that one), and
only while its follower is parked and has written everything before
(``resilience/resume.py``: ``Stream.follow_batches``): the bytes on the wire are
the same, in the same order, as through ``send``.

It is offered for uvicorn's httptools protocol on Linux only (what ``quantroute
serve`` runs there; ``HeadWithBody`` needs ``TCP_CORK`` to hold the head for the
first body), whose request cycle it reads: the transport, whether the response is
chunked, started, complete, or its client gone, and its flow control. Whenever
any of those says no, :meth:`DirectBody.write` refuses and the event goes out
through ``send`` as before, which waits for a slow client's socket to drain.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Send

EXTENSION = "quantroute.direct_body"
_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"
_CYCLE_FIELDS = ("transport", "flow", "chunked_encoding", "disconnected", "response_complete")


class DirectBody:
    """The chunks of one response's body, written from any task on the event loop.

    Closed until the layer that made it opens it (after the response's first body
    went out through ``send``), and for good once that layer's call returns: a
    keep-alive connection's next response has a new one."""

    __slots__ = ("_cycle", "_open", "_transport")

    def __init__(self, cycle: Any):
        self._cycle = cycle
        self._transport = cycle.transport
        self._open = False

    @classmethod
    def of(cls, send: Send) -> DirectBody | None:
        """One for the response ``send`` belongs to: ``None`` unless it is the bound
        ``send`` of uvicorn's httptools request cycle."""
        cycle = getattr(send, "__self__", None)
        if type(cycle).__module__ != _CYCLE_MODULE:
            return None
        if not all(hasattr(cycle, name) for name in _CYCLE_FIELDS):
            return None  # a uvicorn whose cycle we do not know
        return cls(cycle)

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        self._open = False

    def write(self, body: bytes) -> bool:
        """Write ``body`` as one chunk of the response, now; ``False`` (nothing written)
        when it may not: closed, the response not chunked or already complete, the
        client gone, or its socket's buffer full (``send`` waits for that one)."""
        cycle = self._cycle
        if (
            not self._open
            or cycle.disconnected
            or cycle.response_complete
            or cycle.chunked_encoding is not True
            or cycle.flow.write_paused
            or not body
        ):
            return False
        try:
            self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        except Exception:  # a transport closing under us: ``send`` reports it
            self._open = False
            return False
        return True

"""uvicorn's httptools protocol with a bounded request head and a timed body.

uvicorn's httptools parser takes a request head of any size, for as long as the
client likes: a 64 MiB header is read into memory (and parsing 32 MiB holds the
event loop for most of a second), and a connection that sends its head a byte
at a time holds its socket for ever (slowloris). This protocol answers ``431``
to a head (request line and headers) over ``max_head_bytes`` and closes a
connection whose head is not complete ``head_timeout_s`` after the connection
opened or its request's first byte came. A request httptools cannot parse (a NUL
in a header, a ``Content-Length`` of 23 digits) is a ``400`` in OpenAI's shape,
not uvicorn's plain text.

A body sent a byte at a time holds its connection and an ASGI task the same way
(the body limit, ``api/body_limit.py``, bounds its size, not its time). A request
whose body is not complete ``body_timeout_s`` after its head is answered ``408``
(or, if its response has started, cut) and its connection closed; the app's
``receive()`` then says ``http.disconnect``. Each request on a keep-alive
connection has its own clock; one pipelined behind a response still being
written starts it when that response ends (reading is paused meanwhile). A
keep-alive connection between requests is uvicorn's own (``timeout_keep_alive``).
"""

from __future__ import annotations

import asyncio
import logging

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: application/json\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%b"
)
_431_BODY = (
    b'{"error":{"message":"the request\'s headers are too large",'
    b'"type":"invalid_request_error","param":null,"code":"headers_too_large"}}'
)
_400 = (
    b"HTTP/1.1 400 Bad Request\r\n"
    b"content-type: application/json\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%b"
)
_400_BODY = (
    b'{"error":{"message":"the request is not valid HTTP/1.1",'
    b'"type":"invalid_request_error","param":null,"code":"invalid_http"}}'
)
_408 = (
    b"HTTP/1.1 408 Request Timeout\r\n"
    b"content-type: application/json\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%b"
)
_408_BODY = (
    b'{"error":{"message":"the request\'s body did not arrive in time",'
    b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}'
)


class _HeadTooLarge(Exception):
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """See the module docstring; :func:`bounded` sets the three bounds."""

    max_head_bytes = 32 * 1024
    head_timeout_s = 15.0
    body_timeout_s = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due = False  # a request's head is in and its body is still to come
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, but for a head over the limit: a 431, not its plain-text 400; and the
        # body's clock
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__cause__ or exc.__context__, _HeadTooLarge):
                raise
            self._disarm()
            self.transport.write(_431 % (len(_431_BODY), _431_BODY))
            self.transport.close()
        except httptools.HttpParserError:
            log.info("closing a connection whose request is not valid HTTP/1.1")
            self.send_400_response("")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        else:
            # Armed here, not at the head: a body in the head's segment (most) costs no timer.
            self._arm_body()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's, in OpenAI's shape, not plain text (a NUL in a header, a
        ``Content-Length`` of 23 digits: what httptools cannot parse)."""
        self._disarm()
        self._disarm_body()
        self.transport.write(_400 % (len(_400_BODY), _400_BODY))
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        # A request that uvicorn runs (not an upgrade) has a cycle of its own; one with no
        # body (no Content-Length or chunked) is complete before data_received arms.
        self._body_due = self.cycle is not None and self.cycle.scope is self.scope

    def on_message_complete(self) -> None:
        self._disarm_body()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request: its clock starts
        if not self.transport.is_closing():
            self._arm_body()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            raise _HeadTooLarge

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        log.info("closing a connection whose request head took over %gs", self.head_timeout_s)
        self.transport.close()

    def _disarm_body(self) -> None:
        self._body_due = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _arm_body(self) -> None:
        # Not while the request waits behind another's response (pipelined: the parser's
        # request is the last queued one): reading is paused, so its body cannot come, and
        # a 408 would land inside that response. It is armed when the request starts.
        if self._body_due and self._body_timer is None and not self.pipeline:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_late)

    def _body_late(self) -> None:
        self._body_timer = None
        self._body_due = False
        cycle = self.cycle
        log.info("closing a connection whose request body took over %gs", self.body_timeout_s)
        if not cycle.response_started:
            self.transport.write(_408 % (len(_408_BODY), _408_BODY))
        if not cycle.response_complete:
            # What connection_lost will say, said now (it waits for the write buffer to
            # drain): the app's receive() gets http.disconnect, and its send() writes
            # nothing after the 408 and waits on no paused writing.
            cycle.disconnected = True
            cycle.message_event.set()
            self.flow.resume_writing()
        self.transport.close()


def bounded(
    max_head_bytes: int,
    head_timeout_s: float,
    body_timeout_s: float = BoundedHttpToolsProtocol.body_timeout_s,
) -> type[BoundedHttpToolsProtocol]:
    """The protocol class with these bounds (uvicorn takes a class, not an instance)."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {
            "max_head_bytes": max_head_bytes,
            "head_timeout_s": head_timeout_s,
            "body_timeout_s": body_timeout_s,
        },
    )

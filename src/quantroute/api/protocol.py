"""uvicorn's httptools protocol with a bounded request head.

uvicorn's httptools parser takes a request head of any size, for as long as the
client likes: a 64 MiB header is read into memory (and parsing 32 MiB holds the
event loop for most of a second), and a connection that sends its head a byte
at a time holds its socket for ever (slowloris). This protocol answers ``431``
to a head (request line and headers) over ``max_head_bytes`` and closes a
connection whose head is not complete ``head_timeout_s`` after the connection
opened or its request's first byte came. A keep-alive connection between
requests is uvicorn's own (``timeout_keep_alive``). Bodies are the body limit's
(``api/body_limit.py``).
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
_BODY = (
    b'{"error":{"message":"the request\'s headers are too large",'
    b'"type":"invalid_request_error","param":null,"code":"headers_too_large"}}'
)


class _HeadTooLarge(Exception):
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """See the module docstring; :func:`bounded` sets the two bounds."""

    max_head_bytes = 32 * 1024
    head_timeout_s = 15.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, but for a head over the limit: a 431, not its plain-text 400
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__cause__ or exc.__context__, _HeadTooLarge):
                raise
            self._disarm()
            self.transport.write(_431 % (len(_BODY), _BODY))
            self.transport.close()
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

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


def bounded(max_head_bytes: int, head_timeout_s: float) -> type[BoundedHttpToolsProtocol]:
    """The protocol class with these bounds (uvicorn takes a class, not an instance)."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {"max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s},
    )

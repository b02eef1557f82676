"""Refuse request bodies over the configured size with 413, before parsing.

Checks ``Content-Length`` up front and counts the bytes of chunked bodies as
they arrive, so a body without a length cannot slip past the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantroute.errors import PayloadTooLargeError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not self._within(length):
            await self._reject(send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    # An HTTPException passes through FastAPI's body parsing untouched
                    # and is rendered by the error handlers as a 413.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _within(self, length: bytes) -> bool:
        # Digits only, and no longer than the limit's own digits before int() reads
        # them: a 5,000-digit length would pass Python's int() digit limit.
        digits = length.strip()
        return (
            digits.isdigit()
            and len(digits) <= len(str(self.max_body_bytes))
            and int(digits) <= self.max_body_bytes
        )

    def _message(self) -> str:
        return f"The request body is larger than the limit of {self.max_body_bytes} bytes."

    async def _reject(self, send: Send) -> None:
        err = PayloadTooLargeError(self._message())
        body = json.dumps(err.to_openai(), ensure_ascii=False, separators=(",", ":")).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

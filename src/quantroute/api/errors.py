"""One place that renders every error as ``{"error": {...}}`` with its status."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from quantroute.errors import (
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    QuantrouteError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)


def error_response(exc: QuantrouteError) -> JSONResponse:
    headers = {}
    if isinstance(exc, ServiceUnavailableError) and exc.retry_after_s is not None:
        headers["Retry-After"] = str(math.ceil(exc.retry_after_s))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """The first problem, naming its field; the offending value is never echoed."""
    first = exc.errors()[0]
    raw = tuple(first.get("loc", ()))
    loc: list[str] = []
    for part in raw[1:] if raw[:1] == ("body",) else raw:
        text = str(part)
        if text in _TYPE_TAGS or "-" in text or "[" in text:
            break  # pydantic's tag for a member of a union, not a field
        loc.append(text)
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return InvalidRequestError("The request body is not valid JSON.")
    if first.get("type") == "missing" and not loc:
        return InvalidRequestError("The request body is missing.")
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_quantroute(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, QuantrouteError)
        if exc.status >= 500:
            log.error("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(NotFoundError("No such route.", code="not_found"))
        if exc.status_code == 413:
            return error_response(PayloadTooLargeError(str(exc.detail)))
        err = QuantrouteError(str(exc.detail))
        body = err.to_openai()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(body, status_code=exc.status_code)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(QuantrouteError("The server had an internal error."))

    app.add_exception_handler(QuantrouteError, on_quantroute)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)

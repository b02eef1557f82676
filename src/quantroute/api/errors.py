"""One place that renders every error as ``{"error": {...}}`` with its status.

An exception nobody meant (a bug) becomes a 500 with the same shape, rendered by
:class:`InternalErrorMiddleware` *inside* Starlette's ``ServerErrorMiddleware``:
that one re-raises after answering, which makes the server drop the client's
keep-alive connection; ours answers and keeps it. Error bodies never echo the
request: ``param`` names a field of the schema, never a key the client made up.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.api.structured import FORMAT_TAGS
from quantroute.errors import (
    FieldError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    QuantrouteError,
)

log = logging.getLogger(__name__)


def error_response(exc: QuantrouteError) -> JSONResponse:
    headers = {}
    retry_after_s = getattr(exc, "retry_after_s", None)  # 503s and 429s carry one
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# What a location part may be to be named: a field name or a token id (logit_bias).
# Anything else is a key the client chose (or pydantic's tag for a union member,
# "list[TextPart]", "function-after[...]"), and the path stops before it.
_NAMEABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}|[0-9]{1,9}")
_TOKEN_ID = re.compile(r"[0-9]{1,9}")
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # an unknown key that may be named
# Fields whose keys are the client's: a key is named only if it is a token id.
_KEYED = frozenset({"logit_bias"})
# pydantic's messages that quote the input (a union's tag, an attribute's name, a
# parser's complaint about the text), each replaced by one that does not. Every other
# message of pydantic's is built from the schema alone (bounds, patterns, the expected
# literals); "value_error" and "assertion_error" carry our validators' own words.
_QUOTING = {
    "no_such_attribute": "has no such attribute",
    "get_attribute_error": "could not be read",
    "iteration_error": "could not be iterated over",
    "mapping_type": "Input should be a valid mapping",
    "bytes_invalid_encoding": "Data should be validly encoded",
    "date_parsing": "Input should be a valid date in the format YYYY-MM-DD",
    "date_from_datetime_parsing": "Input should be a valid date or datetime",
    "time_parsing": "Input should be in a valid time format",
    "datetime_parsing": "Input should be a valid datetime",
    "datetime_object_invalid": "Invalid datetime object",
    "datetime_from_date_parsing": "Input should be a valid datetime or date",
    "timezone_offset": "Input has the wrong timezone offset",
    "time_delta_parsing": "Input should be a valid duration",
    "url_parsing": "Input should be a valid URL",
    "url_syntax_violation": "Input violated strict URL syntax rules",
    "uuid_parsing": "Input should be a valid UUID",
}
# The context pydantic fills from the input: a message of a type not listed above that
# carries one of these is not passed on either (a type newer than this list).
_INPUT_CONTEXT = frozenset({"error", "tag", "attribute", "tz_actual", "encoding_error"})
_OUR_WORDS = frozenset({"value_error", "assertion_error"})
# OpenAI's request parameters (and ours, sent to the other endpoint): an unknown field
# that is one of these is named, since the name is then this list's, not the client's.
_KNOWN_PARAMETERS = frozenset(
    {
        *("audio", "best_of", "function_call", "functions", "metadata", "modalities"),
        *("prediction", "prompt_cache_key", "reasoning_effort", "safety_identifier"),
        *("service_tier", "store", "suffix", "verbosity", "web_search_options"),
        *ChatCompletionRequest.model_fields,
        *CompletionRequest.model_fields,
    }
)
_TAG_ERRORS = frozenset({"union_tag_invalid", "union_tag_not_found"})


def _location(parts: tuple[object, ...]) -> tuple[list[str], bool]:
    """The part of an error's location that may be named: up to the first key the client
    chose (or pydantic's name for a union member); and whether that is all of it."""
    loc: list[str] = []
    for i, part in enumerate(parts):
        text = str(part)
        if i and parts[i - 1] == "response_format" and text in FORMAT_TAGS:
            continue  # pydantic names the union's member by its tag: not a field
        if i and parts[i - 1] in _KEYED and not _TOKEN_ID.fullmatch(text):
            break  # a key of the client's, not a token id
        if text in _TYPE_TAGS or not _NAMEABLE.fullmatch(text):
            break
        loc.append(text)
    else:
        return loc, True
    return loc, False


def _message(first: Mapping[str, Any]) -> str:
    """pydantic's message for ``first``, unless it may quote the input."""
    kind = str(first.get("type", ""))
    ctx = first.get("ctx") or {}
    message = str(first.get("msg", "invalid value"))
    if kind == "union_tag_invalid":
        return f"should be one of {ctx.get('expected_tags', 'the documented values')}"
    if kind in _QUOTING:
        return _QUOTING[kind]
    if kind not in _OUR_WORDS and _INPUT_CONTEXT & set(ctx):
        return "invalid value"
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return message


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """The first problem, naming its field; the offending value is never echoed. An unknown
    field is named when its name is a plain ASCII name (``frobnicate``, as OpenAI names
    it), else by where it is: a key of other characters is the client's text, unsaid."""
    first = exc.errors()[0]
    kind = first.get("type")
    if kind == "json_invalid":
        return InvalidRequestError("The request body is not valid JSON.")
    raw = tuple(first.get("loc", ()))
    parts = raw[1:] if raw[:1] == ("body",) else raw
    if kind == "extra_forbidden":  # the last part is the client's key
        loc, whole = _location(parts[:-1])
        key = str(parts[-1]) if parts else ""
        if whole and (key in _KNOWN_PARAMETERS or _FIELD_NAME.fullmatch(key)):
            # named as OpenAI names it: a plain ASCII name of at most 64 characters is a
            # field's name, not a value; anything else is the client's text and stays unsaid
            named = ".".join([*loc, key])
            where = "this endpoint" if not loc else ".".join(loc)
            return InvalidRequestError(f"{named}: not a parameter of {where}", param=named)
        if not loc:
            message = "The body has a field that is not a parameter of this endpoint."
            return InvalidRequestError(message)
        holder = ".".join(loc)
        return InvalidRequestError(f"{holder}: has a field that it does not take", param=holder)
    loc, whole = _location(parts)
    ctx = first.get("ctx") or {}
    if whole and isinstance(ctx.get("error"), FieldError):
        loc.append(ctx["error"].field)  # a check across a model's fields blames one
    discriminator = str(ctx.get("discriminator", "")).strip("'")  # pydantic quotes it
    if whole and kind in _TAG_ERRORS and _NAMEABLE.fullmatch(discriminator):
        loc.append(discriminator)  # the field that selects the union's member: "type"
    param = ".".join(loc) or None
    if kind == "missing" and not loc:
        return InvalidRequestError("The request body is missing.")
    message = _message(first)
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


class _Throttle:
    """At most one line per key and ``interval_s``: a 503 is the server shedding load, and
    one line per shed request (the access log has that already) would be written just
    when the server has least room for it."""

    def __init__(
        self, interval_s: float = 1.0, keys: int = 256, clock: Callable[[], float] = time.monotonic
    ):
        self._interval_s = interval_s
        self._keys = keys
        self._clock = clock
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}  # (logged at, held back)

    def admit(self, key: tuple[str, ...]) -> int | None:
        """``None``: hold this line back; else how many lines like it were held back since
        the last one written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self._keys:
            self._last.clear()
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]


_SHED_LOG = _Throttle()


def render_error(exc: Exception, method: str, path: str) -> JSONResponse | None:
    """The answer to an error a request raised on purpose (ours, a schema's, Starlette's);
    ``None`` for anything else (a bug: :class:`InternalErrorMiddleware` answers those).
    A 5xx is logged at ERROR, but a 503 (shedding load, or a deadline or every branch
    out of reach) at WARNING, one line a second per kind at most."""
    if isinstance(exc, QuantrouteError):
        if exc.status == 503:
            held = _SHED_LOG.admit((method, path, exc.error_code or type(exc).__name__))
            if held is not None:
                more = f" ({held} more like it since the last such line)" if held else ""
                log.warning("%s %s: %s%s", method, path, exc.message, more)
        elif exc.status >= 500:
            log.error("%s %s: %s", method, path, exc.message)
        return error_response(exc)
    if isinstance(exc, RequestValidationError):
        return error_response(validation_error(exc))
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return error_response(NotFoundError("No such route.", code="not_found"))
        if exc.status_code == 413:
            return error_response(PayloadTooLargeError(str(exc.detail)))
        err = QuantrouteError(str(exc.detail))
        body = err.to_openai()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
    return None


def install_error_handlers(app: FastAPI) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        response = render_error(exc, request.method, request.url.path)
        if response is None:  # only for what fails outside InternalErrorMiddleware
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(internal_error())
        return response

    for kind in (QuantrouteError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, on_error)
    app.add_middleware(InternalErrorMiddleware)


def internal_error() -> QuantrouteError:
    return QuantrouteError("The server had an internal error.")


class InternalErrorMiddleware:
    """Turn an unexpected exception into a 500 error body, keeping the connection open.

    Sits inside Starlette's ``ServerErrorMiddleware`` (which would answer and then
    re-raise, so that the server closes the connection). If the response had already
    started — a stream — there is nothing to answer with: the exception goes on, and
    the server cuts the connection, which is how a client tells a cut body from a
    whole one.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # it left while sending its body: nobody to answer, no bug
            method, path = scope.get("method"), scope.get("path")
            log.debug("%s %s: the client left before its body was read", method, path)
        except Exception:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error_response(internal_error())(scope, receive, send)

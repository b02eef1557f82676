"""An error as a gRPC status: its code, its message as the details, and its OpenAI
``type``, ``code`` and ``param`` (and a 503's or 429's ``retry-after``) as trailing
metadata.

=========================================  ======================
HTTP status (``errors.py``)                gRPC status code
=========================================  ======================
400 invalid request                        ``INVALID_ARGUMENT``
401 no or wrong key                        ``UNAUTHENTICATED``
403 not allowed                            ``PERMISSION_DENIED``
404 unknown model or branch                ``NOT_FOUND``
413 too large                              ``RESOURCE_EXHAUSTED``
429 over a tenant's limit                  ``RESOURCE_EXHAUSTED``
503 once the request's deadline passed     ``DEADLINE_EXCEEDED``
503 shedding load, nothing ready           ``UNAVAILABLE``
502 engine failed (retryable)              ``UNAVAILABLE``
500 and anything else                      ``INTERNAL``
=========================================  ======================

A 503 is the deadline's when the call had one and it has passed: whatever gave up (the
admission queue, the wait for a first token), it gave up because time ran out. Told
apart by the clock, never by the message's words."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import grpc

from quantroute.errors import QuantrouteError

__all__ = [
    "CODES",
    "ERROR_CODE",
    "ERROR_PARAM",
    "ERROR_TYPE",
    "RETRY_AFTER",
    "Status",
    "status_of",
]

log = logging.getLogger(__name__)

ERROR_TYPE = "x-quantroute-error-type"  # the OpenAI error's type: invalid_request_error, ...
ERROR_CODE = "x-quantroute-error-code"  # its code: model_not_found, rate_limit_exceeded, ...
ERROR_PARAM = "x-quantroute-error-param"  # the field it names
RETRY_AFTER = "retry-after"  # whole seconds, as HTTP's Retry-After

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class Status:
    """What a call ends with: ``context.abort(code, details, trailing)``."""

    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str], ...] = ()


def status_of(exc: QuantrouteError, deadline: float | None = None) -> Status:
    """The status of ``exc`` for a call whose deadline is ``deadline`` (``time.monotonic``;
    ``None``: it had none).

    >>> from quantroute.errors import NotFoundError
    >>> status_of(NotFoundError("no such model")).code
    <StatusCode.NOT_FOUND: (5, 'not found')>
    """
    if exc.status == 503 and deadline is not None and time.monotonic() >= deadline:
        code = grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        code = CODES.get(exc.status) or (
            grpc.StatusCode.INTERNAL if exc.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT
        )
    if exc.status >= 500 and code is not grpc.StatusCode.DEADLINE_EXCEEDED:
        if exc.status == 503:
            log.debug("gRPC call shed: %s", exc.message)  # the access line has it already
        else:
            log.error("gRPC call failed: %s", exc.message)
    trailing = [(ERROR_TYPE, exc.type)]
    if exc.error_code is not None:
        trailing.append((ERROR_CODE, exc.error_code))
    if exc.param is not None:
        trailing.append((ERROR_PARAM, exc.param))
    retry_after_s = getattr(exc, "retry_after_s", None)  # 503s and 429s carry one
    if retry_after_s is not None:
        trailing.append((RETRY_AFTER, str(max(1, math.ceil(retry_after_s)))))
    return Status(code, exc.message, tuple(trailing))

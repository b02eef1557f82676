from __future__ import annotations

import pytest

from quantroute.errors import (
    ContextLengthExceededError,
    EngineCrashedError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    QuantrouteError,
    ServiceUnavailableError,
)


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "retryable"),
    [
        (InvalidRequestError("bad", param="n"), 400, "invalid_request_error", None, False),
        (NotFoundError("no"), 404, "invalid_request_error", "model_not_found", False),
        (PayloadTooLargeError("big"), 413, "invalid_request_error", "payload_too_large", False),
        (EngineCrashedError("dead"), 502, "server_error", "engine_crashed", True),
        (ServiceUnavailableError("busy"), 503, "server_error", "service_unavailable", True),
        (QuantrouteError("x"), 500, "server_error", None, False),
    ],
)
def test_each_error_knows_its_wire_form(
    exc: QuantrouteError, status: int, type_: str, code: str | None, retryable: bool
) -> None:
    body = exc.to_openai()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (exc.status, body["error"]["type"], body["error"]["code"], exc.retryable) == (
        status,
        type_,
        code,
        retryable,
    )


def test_context_length_error_names_both_numbers() -> None:
    exc = ContextLengthExceededError(prompt_tokens=500, max_tokens=100, n_ctx=512)
    assert exc.status == 400 and exc.error_code == "context_length_exceeded"
    assert "512" in exc.message and "600" in exc.message and "500" in exc.message

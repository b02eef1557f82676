"""quantroute's exception hierarchy. Each error knows its HTTP status, its
OpenAI error ``type`` and ``code``, and whether a retry elsewhere may succeed.

::

    QuantrouteError                      500 server_error
    ├── InvalidRequestError              400 invalid_request_error
    │   ├── ContextLengthExceededError   400   code=context_length_exceeded
    │   ├── UnsupportedByBranchError     400   code=unsupported_by_branch (next branch)
    │   └── PayloadTooLargeError         413   code=payload_too_large
    ├── NotFoundError                    404 invalid_request_error (model_not_found)
    ├── AuthenticationError              401 authentication_error (no or wrong key)
    ├── PermissionDeniedError            403 permission_error (admin endpoints closed)
    ├── RateLimitError                   429 rate_limit_error (tenant over its limits)
    ├── ConfigError                      500 (bad settings, manifest or repository)
    │   └── ManifestError
    │       └── ArtifactIntegrityError        (sha256 mismatch, missing file)
    ├── TemplateError                    500 (chat template refused or failed)
    ├── DeviceError                      500 (a device provider could not read)
    ├── InsufficientMemoryError          503 (no device has room for a branch)
    ├── ServiceUnavailableError          503 (nothing ready; Retry-After)
    └── EngineError                      502 server_error, retryable
        ├── EngineUnavailableError       503 (worker not ready / restarting)
        ├── DeviceOutOfMemoryError       503 (no memory for the request on its device)
        └── EngineCrashedError           502 (worker died mid-request)

Messages never echo request content: they name the field and the bound.
Third-party exceptions are translated at the boundary with ``raise X from exc``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class QuantrouteError(Exception):
    """Base of every error quantroute raises on purpose."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self._code = code

    @property
    def error_code(self) -> str | None:
        return self._code or self.code

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.error_code,
            }
        }


class InvalidRequestError(QuantrouteError):
    status = 400
    type = "invalid_request_error"


class UnsupportedByBranchError(InvalidRequestError):
    """What the request asks (``tools``, a field its server does not take) is not what
    this branch can do: an unpinned request moves to the decision's next branch, never
    counted against this one; pinned, or with no branch left, it is the 400."""

    code = "unsupported_by_branch"


class FieldError(ValueError):
    """A schema check across fields that blames one of them: raised in a pydantic model
    validator, it is the 400 whose ``param`` names ``field`` (nested under the model's
    own place), where a plain ``ValueError`` there would name no field at all."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"

    def __init__(self, *, prompt_tokens: int, max_tokens: int, n_ctx: int, at_least: bool = False):
        more = "at least " if at_least else ""  # counted from the prompt's size, not tokenized
        super().__init__(
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{more}{prompt_tokens + max_tokens} tokens ({more}{prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx


class PayloadTooLargeError(InvalidRequestError):
    status = 413
    code = "payload_too_large"


class NotFoundError(QuantrouteError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class AuthenticationError(QuantrouteError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(QuantrouteError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class ConfigError(QuantrouteError):
    """Settings, a manifest or a repository are wrong: an operator's problem."""


class ManifestError(ConfigError):
    pass


class ArtifactIntegrityError(ManifestError):
    code = "artifact_integrity"


class TemplateError(QuantrouteError):
    code = "chat_template_error"


class EngineError(QuantrouteError):
    status = 502
    code = "engine_error"
    retryable = True


class EngineUnavailableError(EngineError):
    status = 503
    code = "engine_unavailable"


class DeviceOutOfMemoryError(EngineError):
    """The branch's device has no memory left for this request (on simulated devices,
    emulated when the device is over its budget, as an allocation would fail)."""

    status = 503
    code = "device_out_of_memory"


class EngineCrashedError(EngineError):
    code = "engine_crashed"


class DeviceError(QuantrouteError):
    """A device provider could not read its devices (driver gone, tool failed, bad output).

    Raised by :meth:`DeviceProvider.read` and by provider constructors; the
    message says what failed and what to check, never just "error".
    """

    code = "device_error"


class InsufficientMemoryError(QuantrouteError):
    """No device (or pair of devices) has the headroom a branch needs."""

    status = 503
    code = "insufficient_device_memory"
    retryable = True


class ServiceUnavailableError(QuantrouteError):
    status = 503
    code = "service_unavailable"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimitError(QuantrouteError):
    """A tenant is over one of its limits (requests or tokens per minute, concurrency)."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

"""The HTTP edge's settings: ``Settings.server`` (the listener and its limits on
connections), ``Settings.limits`` (bounds on request fields) and ``Settings.auth``
(client keys, and which read endpoints need one); ``api/`` reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    grpc_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the gRPC API (docs/grpc.md), on the same host; 0 is off.",
    )
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        le=1 << 24,
        description="Largest request head (request line and headers) accepted; larger gets 431.",
    )
    header_timeout_s: float = Field(
        15.0,
        gt=0,
        le=3600,
        description="A connection whose request head is not complete this long after it "
        "opened (or the request's first byte) is closed.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds a request's body may take after its head; one not complete by "
        "then gets 408 (or, if its response has started, is cut) and the connection is closed.",
    )
    keepalive_s: float = Field(
        15.0, gt=0, description="Seconds between SSE keep-alive comments on an idle stream."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the gateway and its workers."
    )
    admin_key: SecretStr | None = Field(
        None,
        description="Bearer key for /admin/* endpoints; without one they are closed (403).",
    )
    metrics_key: SecretStr | None = Field(
        None,
        description="A read-only Bearer key for what auth.protect_metrics protects (a "
        "scraper's); the admin key opens the same.",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        max_length=256,
        description="Host header names the server answers (a leading '*.' matches any "
        "subdomain, '*' any host; a port is ignored); others get 400. Unset: in open mode "
        "(no keys) only loopback names (localhost, 127.0.0.1, [::1]), against DNS rebinding; "
        "with keys, any.",
    )
    docs: bool = Field(
        False,
        description="Serve the OpenAPI schema (/openapi.json) and its reference page (/docs), "
        "without third-party scripts; off by default.",
    )


class LimitSettings(BaseModel):
    """Bounds on request fields; anything outside them is a 400."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    max_tokens: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_stop: int = Field(4, ge=0, description="Most stop sequences in one request.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop sequence, in characters.")
    max_n: int = Field(4, ge=1, description="Most choices (n) in one request.")
    max_messages: int = Field(1024, ge=1, description="Most chat messages in one request.")
    max_prompt_chars: int = Field(
        1 << 20, ge=1, description="Longest prompt or message content, in characters."
    )
    template_timeout_s: float = Field(
        2.0, gt=0, description="Longest a model's chat template may take to render a prompt."
    )
    template_max_chars: int = Field(
        1 << 24,
        ge=1024,
        description="Longest prompt a chat template may render (and a cap on what it builds).",
    )
    template_max_bytes: int = Field(
        1 << 26,
        ge=1 << 16,
        description="Memory a chat template's render may take, in bytes (its process's "
        "address-space growth); past it the request is a 400.",
    )
    compile_timeout_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="Longest a request's schema, pattern or tool grammar may take to check "
        "and compile (off the event loop); past it the request is a 400 naming the field.",
    )


class AuthSettings(BaseModel):
    """Client API keys (tenants) and which read endpoints need one."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    tenants_file: Path | None = Field(
        None,
        description="YAML file of tenants: keys, priority, rate and concurrency limits, models "
        "(docs/api.md#tenants). Without one the API is open to anyone who reaches the port.",
    )
    protect_metrics: bool = Field(
        True,
        description="With tenants set, GET /metrics, /dashboard/data and /v1/devices (every "
        "tenant's usage, every model) need the admin key or server.metrics_key, and "
        "/readyz answers its status alone to others.",
    )
    protect_explain: bool = Field(
        True,
        description="POST /v1/route/explain needs a client or admin key (when tenants are set).",
    )

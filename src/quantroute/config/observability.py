"""``Settings.observability``: traces, logs and the status page (``observability/``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ObservabilitySettings(BaseModel):
    """Traces, logs and the status page (``observability/``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (http://collector:4318/v1/traces); unset: "
        "no traces, at near-zero cost.",
    )
    service_name: str = Field("quantroute", description="service.name of the traces.")
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Fraction of new traces kept; a client's traceparent decides for its own.",
    )
    log_format: Literal["auto", "json", "plain"] = Field(
        "auto",
        description="Log lines: 'json' (one object a line), 'plain', or 'auto' "
        "(plain on a terminal, JSON otherwise).",
    )
    access_log: bool = Field(
        True, description="One log line per generation request: status, tokens, TTFT, duration."
    )
    recent_decisions: int = Field(
        512, ge=1, le=65536, description="Routing decisions kept for the status page."
    )
    loop_lag_interval_s: float = Field(
        0.01,
        gt=0,
        le=10,
        description="How often the event loop's lag is sampled "
        "(quantroute_event_loop_lag_seconds).",
    )

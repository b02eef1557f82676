"""The request path's settings, read by ``resilience/``: ``Settings.admission`` (the
queue in front of each model), ``Settings.resilience`` (breakers, the retry budget, the
first-token and reader timeouts) and ``Settings.streams`` (resumable streams)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AdmissionSettings(BaseModel):
    """The bounded, prioritised queue in front of each model."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    queue_size: int = Field(
        64, ge=0, description="Requests that may wait for a model; one more is a 503."
    )
    slots_factor: float = Field(
        2.0,
        gt=0,
        description="Requests of a model running at once: its ready branches' decode slots "
        "times this.",
    )
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After of an admission 503.")


class ResilienceSettings(BaseModel):
    """Circuit breakers per branch, the retry budget, and the first-token timeout."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    breaker_failures: int = Field(
        5, ge=1, description="Failures in a row (requests the branch failed) that open its breaker."
    )
    breaker_open_s: float = Field(
        30.0, gt=0, description="How long a breaker first stays open; doubles on each reopening."
    )
    breaker_open_max_s: float = Field(300.0, gt=0, description="Longest a breaker stays open.")
    breaker_half_open_probes: int = Field(
        2, ge=1, description="Requests let through at once to test a half-open breaker."
    )
    retry_ratio: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Retries on another branch in flight: at most this share of active requests.",
    )
    retry_min: int = Field(
        3, ge=0, description="Retries always allowed in flight, whatever the ratio says."
    )
    reader_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A streaming client that reads nothing for this long is cut off (its "
        "sequence is paused in the worker meanwhile, and then freed).",
    )
    first_token_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A branch that sends no first token in this long has failed the request, "
        "which moves to the next branch (a deadline cuts it shorter).",
    )


class StreamSettings(BaseModel):
    """Resumable streams (``GET /v1/streams/{id}``): what is kept of each stream, and how long
    a dropped one keeps generating."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    retention_s: float = Field(
        300.0,
        ge=0,
        description="How long a finished stream's events are kept for a reconnecting client.",
    )
    max_streams: int = Field(
        1024,
        ge=1,
        description="Streams kept at most; over it the oldest finished ones go first (live "
        "ones are never dropped: admission bounds them).",
    )
    max_events_per_stream: int = Field(
        4096,
        ge=16,
        description="Events kept per stream, the latest; a resume from before them is a 404.",
    )
    max_readers: int = Field(
        4,
        ge=1,
        le=1024,
        description="Clients reading one stream at once (the response that started it "
        "included); one more resume is a 429 until one leaves.",
    )
    resume_grace_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="How long a resumable stream keeps generating after its last client left; "
        "if nobody reconnects in time it is cancelled (0: at once).",
    )
    max_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="Bytes of events kept across all streams at most; over it the oldest "
        "finished streams go first, then the oldest events of live ones.",
    )
    resumable_by_default: bool = Field(
        False,
        description="Every stream is resumable; otherwise only those sent with "
        "'x-quantroute-resumable: true' (the others stop generating when their client leaves).",
    )

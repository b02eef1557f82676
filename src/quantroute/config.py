"""The settings tree: the only module that reads environment variables.

Precedence, highest first: command-line flags, environment variables
(``QUANTROUTE_SERVER__PORT=8001``, nested with ``__``), a YAML config file
(``--config FILE`` or ``QUANTROUTE_CONFIG``), then the defaults below.
Every field has a default and a description; the CLI's flags are generated
from this tree (``quantroute serve --help`` lists them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from quantroute.errors import ConfigError
from quantroute.types import WorkerFault

DEMO_REPO = Path(__file__).resolve().parent / "demo" / "repo"
ENV_PREFIX = "QUANTROUTE_"


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
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


class EngineSettings(BaseModel):
    """How llama.cpp worker processes run."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error

    n_ctx: int = Field(
        0, ge=0, description="Context window per sequence; 0 uses the model's training context."
    )
    parallel: int = Field(
        4, ge=1, le=64, description="Sequences a worker decodes together (continuous batching)."
    )
    n_threads: int = Field(
        0, ge=0, description="Threads per worker; 0 splits the cores (less one) among workers."
    )
    n_batch: int = Field(512, ge=16, description="Most tokens in one llama_decode call.")
    start_timeout_s: float = Field(120.0, gt=0, description="Time a worker has to load its model.")
    restart_backoff_s: float = Field(
        0.5, gt=0, description="First wait before restarting a dead worker; doubles each time."
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="Longest restart wait.")
    pin_cpus: bool = Field(
        False,
        description="Pin each worker to its own cores (telemetry.cpu_affinity, or an even split).",
    )
    cancel_grace_s: float = Field(
        5.0, gt=0, description="Time a worker has to exit on shutdown before it is killed."
    )
    max_crashes: int = Field(
        3,
        ge=1,
        description="Failures in a row (a signal, a failed load, a death before any request "
        "finished) after which a branch is marked failed.",
    )
    failed_retry_s: float = Field(
        0.0,
        ge=0,
        description="How often a failed branch is tried again; 0 waits for "
        "POST /admin/branches/{id}/restart.",
    )
    n_gpu_layers: int = Field(
        -1,
        ge=-1,
        description="Layers offloaded to a GPU when a branch is placed on one: -1 all (or as "
        "many as fit), 0 none. Branches on the CPU offload nothing.",
    )
    gen_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a generation's next event from its worker; a worker "
        "that sends nothing at all for this long is replaced.",
    )
    score_timeout_s: float = Field(
        300.0, gt=0, description="Longest a drift-replay scoring command may take."
    )
    max_event_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 23,
        description="Longest event line a worker may send; a longer one fails its request only.",
    )
    prompt_cache: bool = Field(
        True,
        description="Keep finished sequences' KV cells in their slots and reuse the longest "
        "shared token prefix of a new prompt (prefill only the rest).",
    )
    faults: dict[str, WorkerFault] = Field(
        default_factory=dict,
        description="Fault injection for tests: branch name (or model:branch, or '*') -> how "
        "its worker fails, e.g. {'q8_0': 'sigill-at-first-decode'}.",
    )

    def fault_for(self, model: str, branch: str) -> str:
        """The fault injected into a branch's worker ('' for none)."""
        faults = self.faults
        return faults.get(f"{model}:{branch}") or faults.get(branch) or faults.get("*") or ""


MiB = 1 << 20
_ONE = r"(nvml|nvidia-smi|cpu|sim:[^+\s]+)"
_DEVICE_SPEC = re.compile(rf"^(auto|{_ONE}(\+{_ONE})*)$")


class TelemetrySettings(BaseModel):
    """Which devices quantroute watches, how often, and how it turns readings into headroom."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: str = Field(
        "auto",
        description=(
            "Device provider: 'auto' (NVML if it initialises, else nvidia-smi if on PATH, "
            "each plus the host 'cpu' device; else 'cpu' alone), 'nvml', 'nvidia-smi', 'cpu', "
            "or simulated devices such as 'sim:2x24GiB' or 'sim:1x8GiB,1x16GiB;nvlink=0-1'. "
            "Join providers with '+', e.g. 'nvml+cpu'."
        ),
    )
    poll_interval_s: float = Field(
        1.0, ge=0.5, description="Seconds between device readings (at least 0.5)."
    )
    stale_after_intervals: int = Field(
        3, ge=1, description="A snapshot older than this many poll intervals is stale."
    )
    backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait between retries after failed readings."
    )
    health_lambda: float = Field(
        0.5, ge=0, description="λ in the device health factor exp(-λ · recent failures)."
    )
    failure_half_life_s: float = Field(
        300.0, gt=0, description="Half-life, in seconds, of a device failure's weight."
    )
    safety_margin_min_bytes: int = Field(
        128 * MiB, ge=0, description="Smallest memory margin kept free on every device."
    )
    safety_margin_fraction: float = Field(
        0.05, ge=0, lt=1, description="Memory margin as a fraction of a device's total."
    )
    sim_weight_scale: float = Field(
        1.0,
        ge=1.0,
        le=1e6,
        description="Simulated devices count each branch's weights this many times over, to "
        "emulate a larger model of the same precisions (demos and benchmarks).",
    )
    pressure_file: Path | None = Field(
        None,
        description=(
            "JSON file of simulated memory pressure per device ({'sim:0': '6GiB'}), "
            "re-read when it changes; sim devices only."
        ),
    )
    cpu_affinity: list[list[int]] | None = Field(
        None,
        description=(
            "Cores pinned per worker ([[0, 1], [2, 3]]); unset splits the cores among "
            "workers by NUMA node."
        ),
    )
    nvidia_smi_path: str = Field(
        "nvidia-smi", description="The nvidia-smi executable, for the nvidia-smi provider."
    )
    nvidia_smi_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait for one nvidia-smi run."
    )
    cgroup_root: Path = Field(
        Path("/sys/fs/cgroup"),
        description="Where the cgroup filesystem is mounted (memory limit of the cpu device).",
    )

    @field_validator("devices")
    @classmethod
    def _known_provider(cls, value: str) -> str:
        value = value.strip()
        if not _DEVICE_SPEC.match(value):
            raise ValueError(
                f"unknown device provider {value!r}: want auto, nvml, nvidia-smi, cpu or "
                "sim:COUNTxSIZE[,COUNTxSIZE...], joined with '+'"
            )
        return value

    @field_validator("cpu_affinity")
    @classmethod
    def _non_empty_sets(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        if value is not None:
            for i, cores in enumerate(value):
                if not cores or any(c < 0 for c in cores):
                    raise ValueError(f"cpu_affinity[{i}] must list non-negative core ids")
        return value


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


class DriftSettings(BaseModel):
    """The run-time drift monitor: live requests replayed through the reference."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(
        0.02, ge=0, le=1, description="Share of finished requests replayed (when there is room)."
    )
    window_tokens: int = Field(256, ge=8, description="Scored tokens per drift window.")
    windows_to_flag: int = Field(
        3, ge=1, description="Consecutive out-of-bounds windows that mark a branch degraded."
    )
    windows_to_recover: int = Field(
        3, ge=1, description="Consecutive in-bounds windows that clear the mark."
    )
    kld_delta: float = Field(
        0.05,
        gt=0,
        description="δ: a window is out of bounds when its mean KLD exceeds the "
        "profiled mean KLD by more than this.",
    )
    top1_delta: float = Field(
        0.05, gt=0, le=1, description="Δ: ...or its top-1 agreement is this far below the profile."
    )
    queue: int = Field(8, ge=1, description="Replays waiting at most; more are dropped.")
    max_tokens: int = Field(
        256, ge=1, description="Longest generated text replayed (its first tokens)."
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


# -- routing ---------------------------------------------------------------------

GiB = 1 << 30


class Tier(StrEnum):
    """The quality tiers a request may name in ``quality`` or ``x-quantroute-quality``."""

    EXACT = "exact"
    HIGH = "high"
    BALANCED = "balanced"
    FAST = "fast"


OnInfeasible = Literal["wait", "reject", "best_effort"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierSettings(_Frozen):
    """One tier's quality bounds and what happens when no branch can meet them now."""

    max_kld: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Largest profiled mean KL divergence from the reference (nats/token); "
        "0 admits only the reference; unset means no KLD bound.",
    )
    min_top1: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Smallest profiled top-1 agreement with the reference; unset means no bound.",
    )
    on_infeasible: OnInfeasible = Field(
        default="reject",
        description="When no branch is feasible: 'wait' (the caller waits up to wait_s and "
        "retries, then 503), 'reject' (503 with Retry-After) or 'best_effort' (the cheapest "
        "ready branch, ignoring memory and deadline; only for a tier without bounds).",
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=600,
        description="Longest wait for a feasible branch when on_infeasible is 'wait'.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TierSettings:
        if self.on_infeasible == "wait" and self.wait_s <= 0:
            raise ValueError("on_infeasible 'wait' needs wait_s > 0")
        if self.on_infeasible == "best_effort" and (
            self.max_kld is not None or self.min_top1 is not None
        ):
            raise ValueError(
                "on_infeasible 'best_effort' would break the tier's own bounds; "
                "use it only for a tier without max_kld and min_top1"
            )
        return self

    @property
    def bounded(self) -> bool:
        """Whether the tier has any quality bound."""
        return self.max_kld is not None or self.min_top1 is not None


# Each tier's defaults, in one place: a partial override (``QUANTROUTE_ROUTING__TIERS__HIGH__
# MAX_KLD=0.005``) is merged with them, so it does not reset the tier's other bound.
_TIER_DEFAULTS: dict[str, dict[str, Any]] = {
    "exact": {"max_kld": 0.0, "on_infeasible": "wait", "wait_s": 5.0},
    "high": {"max_kld": 0.001, "min_top1": 0.98},
    "balanced": {"max_kld": 0.02, "min_top1": 0.90},
    "fast": {"on_infeasible": "best_effort"},
}


class TiersSettings(_Frozen):
    """The four tiers. ``exact`` admits only the reference; ``fast`` admits anything ready.

    A tier given in part keeps its other defaults; set a bound to ``null`` to remove it.
    """

    exact: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["exact"]),
        description="Only the reference (max_kld 0); when it cannot serve now, wait for it.",
    )
    high: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["high"]),
        description="Near-lossless branches; 503 when none can serve now.",
    )
    balanced: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["balanced"]),
        description="The default tier: small measured loss; 503 when none can serve now.",
    )
    fast: TierSettings = Field(
        default_factory=lambda: TierSettings(**_TIER_DEFAULTS["fast"]),
        description="No quality bound; when nothing is feasible, the cheapest ready branch.",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            name: {**_TIER_DEFAULTS[name], **given}
            if name in _TIER_DEFAULTS and isinstance(given, dict)
            else given
            for name, given in data.items()
        }

    def get(self, tier: Tier) -> TierSettings:
        """The settings of ``tier``."""
        result: TierSettings = getattr(self, tier.value)
        return result


class ScoreWeights(_Frozen):
    """Weights of the score terms; each term lies in [0, 1], higher is better.

    ``fit`` is the memory-regime fit and dominates by default: the other terms
    (summing to 0.75) shift the choice between branches whose fit is close,
    e.g. away from a saturated branch to an idle one a step down.
    """

    fit: float = Field(
        default=1.0, ge=0, description="Memory-regime fit (precision vs free memory)."
    )
    headroom: float = Field(
        default=0.1,
        ge=0,
        description="Device memory left after admitting the request, / device total.",
    )
    load: float = Field(
        default=0.3,
        ge=0,
        description="1 - load: sequences running and queued against parallel slots.",
    )
    latency: float = Field(
        default=0.1, ge=0, description="Deadline slack: 1 - predicted latency / deadline."
    )
    health: float = Field(default=0.2, ge=0, description="Device health factor in [0, 1].")
    heat: float = Field(default=0.05, ge=0, description="1 - device thermal pressure in [0, 1].")


class SpeedSettings(_Frozen):
    """Each branch's live end-to-end speed, which the deadline filter predicts with
    (``routing/speeds.py``)."""

    weight: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Weight of a finished request in a branch's observed TTFT and time per "
        "output token (an exponentially weighted mean).",
    )
    max_age_s: float = Field(
        default=60.0,
        gt=0,
        description="A branch's observed speed is dropped after this long without a finished "
        "request; the deadline filter then reads the profile again.",
    )
    margin_deviations: float = Field(
        default=0.0,
        ge=0,
        description="With a deadline, branches whose observed prediction plus this many "
        "deviations still meets it go first; the others (in time only on average) follow "
        "as fallbacks. 0 (the default): no margin; 2 is a TCP-like choice.",
    )
    reach_deviations: float = Field(
        default=2.0,
        ge=0,
        description="With a deadline and no branch predicted in time, the branches that fail "
        "only the deadline and whose observed prediction minus this many deviations still "
        "meets it are tried, fastest first, instead of a 503 (the prediction is a mean, and "
        "a request is cut at its deadline). 0: a predicted miss is always a 503.",
    )


class RoutingSettings(_Frozen):
    """How the policy maps a request's requirement and the live state to a branch."""

    tiers: TiersSettings = Field(
        default_factory=lambda: TiersSettings(), description="Quality bounds of the named tiers."
    )
    default_tier: Tier = Field(
        default=Tier.BALANCED, description="Tier of a request that states no quality requirement."
    )
    ample_free_bytes: int = Field(
        default=8 * GiB,
        ge=0,
        description="A device with at least this much free memory is in the ample regime: "
        "the most faithful feasible branch fits best.",
    )
    tight_free_bytes: int = Field(
        default=4 * GiB,
        ge=0,
        description="Below this much free memory a device is tight: the cheapest feasible "
        "branch fits best. Between tight and ample it is constrained.",
    )
    constrained_cost_ratio: float = Field(
        default=0.6,
        gt=0,
        le=1,
        description="In the constrained regime, the most faithful branch whose bits per weight "
        "are at most this fraction of the reference's fits best.",
    )
    fit_decay: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Fit multiplier per step down the fidelity order of the feasible branches.",
    )
    weights: ScoreWeights = Field(
        default_factory=lambda: ScoreWeights(), description="Weights of the score terms."
    )
    load_saturation: float = Field(
        default=2.0,
        gt=0,
        description="(running + queued) / parallel at which the load term reaches 0.",
    )
    top_k: int = Field(
        default=2,
        ge=1,
        le=16,
        description="Most branches among which prompt-prefix affinity breaks a near tie.",
    )
    tie_epsilon: float = Field(
        default=0.02,
        ge=0,
        description="Scores within this of the best are a near tie, broken by prefix affinity.",
    )
    retry_after_s: float = Field(
        default=2.0,
        gt=0,
        description="Retry-After of a 503 when no branch can meet the requirement.",
    )
    residency: bool = Field(
        default=True,
        description="Unload branches when their device runs out of memory and load them back "
        "when it has room again (see routing/residency.py).",
    )
    reload_margin_bytes: int = Field(
        default=512 * MiB,
        ge=0,
        description="Room beyond its footprint a device needs before an unloaded branch is "
        "loaded again (hysteresis).",
    )
    speeds: SpeedSettings = Field(
        default_factory=lambda: SpeedSettings(),
        description="Observed end-to-end speeds for the deadline filter.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> RoutingSettings:
        if self.tight_free_bytes > self.ample_free_bytes:
            raise ValueError("tight_free_bytes must not exceed ample_free_bytes")
        return self


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


class RepositorySettings(_Frozen):
    """The model repository while serving: signatures, file checks, hot reload."""

    require_signatures: bool = Field(
        False,
        description="Refuse a model without a model.sig that verifies (OpenSSF model signing).",
    )
    public_key: Path | None = Field(
        None, description="EC public key (PEM) that verifies model signatures, offline."
    )
    sigstore_identity: str | None = Field(
        None, description="Sigstore signer identity (an email or URI) that signatures must have."
    )
    sigstore_issuer: str | None = Field(
        None, description="OIDC issuer of sigstore_identity, e.g. https://accounts.google.com."
    )
    watch: bool = Field(
        True, description="Reload a model when its folder changes (temporary files are ignored)."
    )
    watch_debounce_ms: int = Field(
        1000, ge=50, le=60_000, description="Quiet time after the last change before reloading."
    )
    drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for requests on a replaced version to finish before it stops.",
    )
    drain_quiet_s: float = Field(
        0.5,
        ge=0,
        description="A replaced version stops once it has had nothing in flight this long.",
    )
    check_timeout_s: float = Field(
        30.0, gt=0, description="Time limit of the child process that checks GGUF headers."
    )
    check_memory_bytes: int = Field(
        1 << 30, ge=64 << 20, description="Address-space limit of the GGUF-checking child."
    )
    follow_links: bool = Field(
        False,
        description="Follow a symbolic link (a branch's file or folder) that leads out of its "
        "model's folder; off: such a file fails its branch.",
    )


class Settings(BaseSettings):
    """Everything quantroute can be told. See docs/configuration.md."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    repo: Path = Field(DEMO_REPO, description="Model repository: one folder per model.")
    server: ServerSettings = Field(default_factory=ServerSettings)  # type: ignore[arg-type]
    limits: LimitSettings = Field(default_factory=LimitSettings)  # type: ignore[arg-type]
    engine: EngineSettings = Field(default_factory=EngineSettings)  # type: ignore[arg-type]
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)  # type: ignore[arg-type]
    drift: DriftSettings = Field(default_factory=DriftSettings)  # type: ignore[arg-type]
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)  # type: ignore[arg-type]
    auth: AuthSettings = Field(default_factory=AuthSettings)  # type: ignore[arg-type]
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)  # type: ignore[arg-type]
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    streams: StreamSettings = Field(default_factory=StreamSettings)  # type: ignore[arg-type]
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)  # type: ignore[arg-type]
    repository: RepositorySettings = Field(default_factory=RepositorySettings)  # type: ignore[arg-type]


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from flags (``overrides``), environment, file and defaults.

    >>> load_settings(server={"port": 9000}).server.port
    9000
    """
    path = config_file or os.environ.get(f"{ENV_PREFIX}CONFIG")
    read = _reading(environment=True, yaml_file=Path(path) if path else None)

    if path and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    _check_environment(os.environ)
    try:
        return read(**overrides)
    except ValidationError as exc:
        raise _config_error(exc) from exc
    except ValueError as exc:  # pydantic-settings' SettingsError: a variable it can't decode
        raise ConfigError(f"settings: {exc}".split("\n", 1)[0]) from exc


def default_settings() -> Settings:
    """What a fresh server has: the defaults alone, no environment and no file (the
    defaults ``--help`` and docs/configuration.md show)."""
    return _reading(environment=False, yaml_file=None)()  # type: ignore[call-arg]  # every field has its default


def _reading(*, environment: bool, yaml_file: Path | None) -> type[Settings]:
    """:class:`Settings` reading, after its arguments, the environment (or not) and a
    YAML file (or none)."""

    class _Read(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings] if environment else [init_settings]
            if yaml_file is not None:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
            return tuple(sources)

    return _Read


def _config_error(exc: ValidationError) -> ConfigError:
    """A settings error in one line: the setting (and its variable), what is wrong, and
    what it accepts (a section's names for an unknown key)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"]]
    where = ".".join(loc)
    variable = ENV_PREFIX + "__".join(loc).upper()
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section: Any = Settings
        for part in loc[:-1]:
            fields = getattr(section, "model_fields", {})
            section = fields[part].annotation if part in fields else None
        if isinstance(section, type) and issubclass(section, BaseModel):
            names = ", ".join(sorted(section.model_fields))
            message = f"no such setting; accepted: {names}"
    return ConfigError(f"setting {where} ({variable} or the config file): {message}", param=where)


def _check_environment(environ: Mapping[str, str]) -> None:
    """A ``QUANTROUTE_`` variable that starts like a setting but names none is an error:
    ``QUANTROUTE_ENGINE_PARALLEL`` (one ``_`` where ``__`` joins the names) or
    ``QUANTROUTE_REPOO`` would otherwise be ignored without a word. A name inside a
    section (``QUANTROUTE_ENGINE__BOGUS``) is the settings' own check; one that starts like
    no setting (the build's ``QUANTROUTE_LLAMA_BACKEND``) is another tool's."""
    roots = set(Settings.model_fields)
    for name in sorted(environ):
        rest = name[len(ENV_PREFIX) :].lower() if name.startswith(ENV_PREFIX) else None
        if rest is None or rest == "config" or rest.split("__", 1)[0] in roots:
            continue
        root = next((r for r in sorted(roots, key=len, reverse=True) if rest.startswith(r)), None)
        if root is not None:
            tail = rest[len(root) :].lstrip("_")
            kind = Settings.model_fields[root].annotation
            section = isinstance(kind, type) and issubclass(kind, BaseModel)
            meant = f"{ENV_PREFIX}{root.upper()}__{tail.upper()}"
            hint = f" (nested names are joined with __: {meant}?)" if section and tail else ""
            raise ConfigError(f"unknown setting in the environment: {name}{hint}", param=name)


OTEL_PREFIX = "OTEL_"


def otel_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The standard OpenTelemetry variables (``OTEL_*``) as set, for
    :mod:`quantroute.observability.otel` to resolve against ``observability.*``: the one
    other place the environment speaks to quantroute, read here like every setting."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k.startswith(OTEL_PREFIX)}

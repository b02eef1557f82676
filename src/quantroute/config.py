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
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from quantroute.errors import ConfigError

DEMO_REPO = Path(__file__).resolve().parent / "demo" / "repo"
ENV_PREFIX = "QUANTROUTE_"


class ServerSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    keepalive_s: float = Field(
        15.0, gt=0, description="Seconds between SSE keep-alive comments on an idle stream."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the gateway and its workers."
    )


class LimitSettings(BaseModel):
    """Bounds on request fields; anything outside them is a 400."""

    max_tokens: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_stop: int = Field(4, ge=0, description="Most stop sequences in one request.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop sequence, in characters.")
    max_n: int = Field(4, ge=1, description="Most choices (n) in one request.")
    max_messages: int = Field(1024, ge=1, description="Most chat messages in one request.")
    max_prompt_chars: int = Field(
        1 << 20, ge=1, description="Longest prompt or message content, in characters."
    )


class EngineSettings(BaseModel):
    """How llama.cpp worker processes run."""

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


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from flags (``overrides``), environment, file and defaults.

    >>> load_settings(server={"port": 9000}).server.port
    9000
    """
    path = config_file or os.environ.get(f"{ENV_PREFIX}CONFIG")

    class _FileSettings(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
            if path:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=Path(path)))
            return tuple(sources)

    if path and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return _FileSettings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"setting {where}: {message}", param=where) from exc

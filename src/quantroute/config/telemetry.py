"""``Settings.telemetry``: which devices quantroute watches and how (``telemetry/``)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

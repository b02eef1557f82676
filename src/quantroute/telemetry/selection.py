"""Choosing device providers from a configuration string, and joining several into one."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quantroute.errors import ConfigError
from quantroute.telemetry.cpu import DEFAULT_CGROUP_ROOT, CpuProvider
from quantroute.telemetry.health import HealthTracker
from quantroute.telemetry.nvml import NvmlProvider
from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.poller import DevicePoller
from quantroute.telemetry.protocol import DeviceProvider
from quantroute.telemetry.settings import TelemetrySettings
from quantroute.telemetry.sim import SimDeviceProvider
from quantroute.telemetry.smi import CommandRunner, SmiProvider
from quantroute.telemetry.stats import DeviceError, DeviceStats
from quantroute.telemetry.topology import Topology

logger = logging.getLogger(__name__)


class CompositeProvider:
    """Several providers read as one (GPUs plus the host ``cpu`` device). A failure of any
    part fails the read: a snapshot must not silently lose devices."""

    def __init__(self, providers: Sequence[DeviceProvider]) -> None:
        if not providers:
            raise ValueError("a composite provider needs at least one provider")
        self.providers = tuple(providers)

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self.providers)

    def read(self) -> list[DeviceStats]:
        devices = [d for p in self.providers for d in p.read()]
        ids = [d.id for d in devices]
        if len(set(ids)) != len(ids):
            raise DeviceError(f"providers {self.name} report duplicate device ids {ids}")
        return devices

    def topology(self) -> Topology:
        return Topology.from_links(link for p in self.providers for link in p.topology())

    def close(self) -> None:
        for provider in reversed(self.providers):
            provider.close()


def _gpu_provider(
    nvml_module: Any | None, smi_binary: str, smi_runner: CommandRunner | None, timeout_s: float
) -> DeviceProvider | None:
    try:
        return NvmlProvider(nvml_module)
    except DeviceError as exc:
        logger.info("NVML unavailable (%s); trying nvidia-smi", exc)
    if smi_runner is None and shutil.which(smi_binary) is None:
        logger.info("%s not on PATH; no GPU provider", smi_binary)
        return None
    smi = SmiProvider(binary=smi_binary, runner=smi_runner, timeout_s=timeout_s)
    try:
        smi.read()
    except DeviceError as exc:
        logger.warning("nvidia-smi present but unusable: %s", exc)
        return None
    return smi


def open_provider(
    spec: str = "auto",
    *,
    pressure_file: Path | None = None,
    nvml_module: Any | None = None,
    smi_binary: str = "nvidia-smi",
    smi_runner: CommandRunner | None = None,
    smi_timeout_s: float = 10.0,
    cgroup_root: Path = DEFAULT_CGROUP_ROOT,
) -> DeviceProvider:
    """Build the provider a configuration string names (see :class:`TelemetrySettings.devices`).

    ``auto``: NVML if it initialises, else nvidia-smi if on PATH and working,
    each joined with the host ``cpu`` device; else ``cpu`` alone. Explicit
    names fail loudly (:class:`DeviceError`) when their devices are missing.

    >>> open_provider("sim:2x24GiB").name
    'sim'
    """
    spec = spec.strip()
    if spec == "auto":
        cpu = CpuProvider(cgroup_root=cgroup_root)
        gpu = _gpu_provider(nvml_module, smi_binary, smi_runner, smi_timeout_s)
        return cpu if gpu is None else CompositeProvider([gpu, cpu])
    providers: list[DeviceProvider] = []
    try:
        for part in spec.split("+"):
            part = part.strip()
            if part == "nvml":
                providers.append(NvmlProvider(nvml_module))
            elif part == "nvidia-smi":
                providers.append(
                    SmiProvider(binary=smi_binary, runner=smi_runner, timeout_s=smi_timeout_s)
                )
            elif part == "cpu":
                providers.append(CpuProvider(cgroup_root=cgroup_root))
            elif part.startswith("sim:"):
                try:
                    providers.append(SimDeviceProvider.from_spec(part, pressure_file=pressure_file))
                except ValueError as exc:
                    raise ConfigError(str(exc), param="devices") from exc
            else:
                raise ConfigError(f"unknown device provider {part!r}", param="devices")
    except Exception:
        for provider in providers:
            provider.close()
        raise
    return providers[0] if len(providers) == 1 else CompositeProvider(providers)


def provider_from_settings(
    settings: TelemetrySettings, *, nvml_module: Any | None = None
) -> DeviceProvider:
    """:func:`open_provider` with every option taken from ``settings``."""
    return open_provider(
        settings.devices,
        pressure_file=settings.pressure_file,
        nvml_module=nvml_module,
        smi_binary=settings.nvidia_smi_path,
        smi_timeout_s=settings.nvidia_smi_timeout_s,
        cgroup_root=settings.cgroup_root,
    )


def health_from_settings(settings: TelemetrySettings) -> HealthTracker:
    """A :class:`HealthTracker` with ``health_lambda`` and ``failure_half_life_s``."""
    return HealthTracker(lam=settings.health_lambda, half_life_s=settings.failure_half_life_s)


def poller_from_settings(
    provider: DeviceProvider, settings: TelemetrySettings, *, health: HealthTracker | None = None
) -> DevicePoller:
    """A :class:`DevicePoller` over ``provider`` with the interval, staleness and backoff
    of ``settings``; the caller starts and stops it, then closes the provider."""
    return DevicePoller(
        provider,
        interval_s=settings.poll_interval_s,
        stale_after_intervals=settings.stale_after_intervals,
        backoff_max_s=settings.backoff_max_s,
        health=health,
    )


def margin_from_settings(
    settings: TelemetrySettings, fragmentation_bytes: dict[str, int] | None = None
) -> MarginPolicy:
    """The :class:`MarginPolicy` placement and ``GET /v1/devices`` use."""
    return MarginPolicy(
        min_bytes=settings.safety_margin_min_bytes,
        fraction=settings.safety_margin_fraction,
        fragmentation_bytes=fragmentation_bytes,
    )

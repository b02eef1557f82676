"""What a device provider reports: one immutable record per device per reading.

All memory is in bytes, power in watts, temperature in °C, clocks in MHz,
utilisation as a fraction in [0, 1]. ``None`` means the device or driver does
not report that value (NVML ``NotSupported``, nvidia-smi ``[N/A]``), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from quantroute.errors import DeviceError, InsufficientMemoryError

__all__ = [
    "DeviceError",
    "DeviceKind",
    "DeviceStats",
    "GpuProcess",
    "InsufficientMemoryError",
    "MigInstance",
]


class DeviceKind(StrEnum):
    """What kind of memory a device has; ids start with it: ``cuda:0``, ``cpu``, ``sim:1``."""

    CUDA = "cuda"
    CPU = "cpu"
    SIM = "sim"


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process holding memory on a GPU. ``used_bytes`` is ``None`` where the
    driver hides it (Windows WDDM, some containers)."""

    pid: int
    used_bytes: int | None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG slice of a GPU (A100/H100 in MIG mode): its own memory, its own ids."""

    index: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    total_bytes: int
    used_bytes: int
    free_bytes: int
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """One device at one moment.

    ``id`` is stable across readings: ``cuda:N`` with N the NVML / nvidia-smi
    index (PCI bus order; set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA agrees),
    ``cpu`` for host memory, ``sim:N`` for simulated devices.

    ``healthy`` is the provider's own verdict (GPU lost, memory unreadable);
    error history and decay live in :class:`~quantroute.telemetry.health.HealthTracker`.
    ``ecc_errors`` (volatile uncorrected) and ``xid_errors`` are counters since
    driver load / provider start; a rise between two readings is a failure.

    >>> DeviceStats(id="sim:0", kind=DeviceKind.SIM, name="sim", total_bytes=100,
    ...             used_bytes=30, free_bytes=70).used_fraction
    0.3
    """

    id: str
    kind: DeviceKind
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    ecc_errors: int | None = None
    xid_errors: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    mig: tuple[MigInstance, ...] = ()
    healthy: bool = True
    uuid: str | None = None
    index: int | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if min(self.total_bytes, self.used_bytes, self.free_bytes) < 0:
            raise ValueError(f"{self.id}: negative memory figure")
        if self.utilization is not None and not 0.0 <= self.utilization <= 1.0:
            raise ValueError(f"{self.id}: utilization {self.utilization} outside [0, 1]")

    @property
    def used_fraction(self) -> float:
        """Used / total, 0 for a device reporting no memory."""
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0

"""NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

The module object is injectable: tests pass a fake shaped like ``pynvml``
(same function names, the real error classes and constants), since no GPU is
attached to the machines this project is developed on.

A value the GPU does not support (``NVMLError_NotSupported``) or hides
(``NVMLError_NoPermission``) is ``None``. Any other NVML error on a device
marks that device unhealthy for this reading (``GPU is lost`` is the classic);
the other devices are still reported. XID critical errors are counted from an
NVML event set drained (without waiting) at every read.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from quantroute.telemetry.stats import DeviceError, DeviceKind, DeviceStats, GpuProcess, MigInstance
from quantroute.telemetry.topology import Link, LinkKind, Topology

logger = logging.getLogger(__name__)

T = TypeVar("T")

# nvmlGpuTopologyLevel_t → the nvidia-smi vocabulary. INTERNAL (two GPUs on one
# board) is at least as near as PIX.
_LEVELS: dict[int, LinkKind] = {
    0: LinkKind.PIX,  # NVML_TOPOLOGY_INTERNAL
    10: LinkKind.PIX,  # NVML_TOPOLOGY_SINGLE
    20: LinkKind.PXB,  # NVML_TOPOLOGY_MULTIPLE
    30: LinkKind.PHB,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: LinkKind.NODE,  # NVML_TOPOLOGY_NODE
    50: LinkKind.SYS,  # NVML_TOPOLOGY_SYSTEM
}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(bus_id: str | bytes) -> str:
    """``"00000000:07:00.0"`` and ``"0000:07:00.0"`` → ``"0000:07:00.0"`` (lower case)."""
    text = _text(bus_id).strip().lower()
    domain, _, rest = text.rpartition(":")
    domain, _, bus = domain.rpartition(":") if domain.count(":") else ("", "", domain)
    try:
        return f"{int(domain or '0', 16):04x}:{bus}:{rest}"
    except ValueError:
        return text


class NvmlProvider:
    """GPUs as ``cuda:N`` devices, read through NVML. Raises :class:`DeviceError` if NVML
    does not initialise (no driver, no library, no GPU)."""

    def __init__(self, nvml_module: Any | None = None, *, watch_xid: bool = True) -> None:
        nvml: Any = nvml_module
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError as exc:
                raise DeviceError("nvidia-ml-py (pynvml) is not installed") from exc
        self._nvml = nvml
        self._events: Any = None
        self._open = False
        self._memory_v2 = True
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise DeviceError(f"NVML failed to initialise: {exc}") from exc
        self._open = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                raise DeviceError("NVML initialised but reports no GPU")
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._names = [_text(nvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except nvml.NVMLError as exc:
            self.close()
            raise DeviceError(f"NVML could not enumerate GPUs: {exc}") from exc
        except DeviceError:
            self.close()
            raise
        self._xid_counts: list[int | None] = [None] * count
        if watch_xid:
            self._watch_xid()

    @property
    def name(self) -> str:
        return "nvml"

    def _watch_xid(self) -> None:
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            logger.info("NVML events unavailable, XID errors not counted: %s", exc)
            return
        for i, handle in enumerate(self._handles):
            try:
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
                self._xid_counts[i] = 0
            except nvml.NVMLError as exc:
                logger.info("cuda:%d: XID events not supported: %s", i, exc)

    def _drain_xid(self) -> None:
        nvml = self._nvml
        if self._events is None:
            return
        for _ in range(10_000):  # bounded: a storm of events must not stall a poll
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            except nvml.NVMLError as exc:
                logger.warning("reading NVML events failed: %s", exc)
                return
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                continue
            if 0 <= index < len(self._xid_counts):
                logger.warning("cuda:%d: XID %d", index, data.eventData)
                self._xid_counts[index] = (self._xid_counts[index] or 0) + 1

    def _memory(self, handle: Any) -> Any:
        """Memory info v2 where the driver has it: ``used`` then excludes the driver's
        reserved memory, as nvidia-smi reports it (v1's ``used`` is ``total - free``)."""
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except (
                nvml.NVMLError_FunctionNotFound,
                nvml.NVMLError_ArgumentVersionMismatch,
                nvml.NVMLError_NotSupported,
            ):
                logger.info("NVML memory info v2 unavailable; using v1")
                self._memory_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        nvml = self._nvml
        try:
            return fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission):
            return None

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        found: dict[int, GpuProcess] = {}
        for getter in (
            self._nvml.nvmlDeviceGetComputeRunningProcesses,
            self._nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for proc in self._optional(getter, handle) or []:
                used = proc.usedGpuMemory
                found.setdefault(int(proc.pid), GpuProcess(int(proc.pid), used))
        return tuple(found[pid] for pid in sorted(found))

    def _mig(self, handle: Any) -> tuple[MigInstance, ...]:
        nvml = self._nvml
        mode = self._optional(nvml.nvmlDeviceGetMigMode, handle)
        if mode is None or mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
            return ()
        out = []
        for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError_NotFound:
                continue
            mem = self._memory(mig)
            out.append(
                MigInstance(
                    index=i,
                    gpu_instance_id=self._optional(nvml.nvmlDeviceGetGpuInstanceId, mig),
                    compute_instance_id=self._optional(nvml.nvmlDeviceGetComputeInstanceId, mig),
                    total_bytes=int(mem.total),
                    used_bytes=int(mem.used),
                    free_bytes=int(mem.free),
                    uuid=_text(uuid)
                    if (uuid := self._optional(nvml.nvmlDeviceGetUUID, mig))
                    else None,
                )
            )
        return tuple(out)

    def _read_one(self, i: int, handle: Any) -> DeviceStats:
        nvml = self._nvml
        mem = self._memory(handle)
        util = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
        power_mw = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
        return DeviceStats(
            id=f"cuda:{i}",
            kind=DeviceKind.CUDA,
            name=self._names[i],
            total_bytes=int(mem.total),
            used_bytes=int(mem.used),
            free_bytes=int(mem.free),
            utilization=util.gpu / 100.0 if util is not None else None,
            temperature_c=self._optional(
                nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
            ),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_mhz=self._optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
            ecc_errors=self._optional(
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            ),
            xid_errors=self._xid_counts[i],
            processes=self._processes(handle),
            mig=self._mig(handle),
            uuid=self._uuids[i],
            index=i,
        )

    def read(self) -> list[DeviceStats]:
        if not self._open:
            raise DeviceError("NVML provider is closed")
        nvml = self._nvml
        self._drain_xid()
        out = []
        for i, handle in enumerate(self._handles):
            try:
                out.append(self._read_one(i, handle))
            except nvml.NVMLError as exc:
                logger.warning("cuda:%d unreadable: %s", i, exc)
                out.append(
                    DeviceStats(
                        id=f"cuda:{i}",
                        kind=DeviceKind.CUDA,
                        name=self._names[i],
                        total_bytes=0,
                        used_bytes=0,
                        free_bytes=0,
                        xid_errors=self._xid_counts[i],
                        healthy=False,
                        uuid=self._uuids[i],
                        index=i,
                        detail=f"NVML: {exc}",
                    )
                )
        return out

    def _nvlinks(self) -> tuple[Counter[tuple[int, int]], dict[int, int]]:
        """Active NVLinks: GPU↔GPU pairs counted, and links into an NVSwitch per GPU."""
        nvml = self._nvml
        by_bus: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle)
            if pci is not None:
                by_bus[normalize_bus_id(pci.busId)] = i
        pairs: Counter[tuple[int, int]] = Counter()
        switch: dict[int, int] = {}
        for i, handle in enumerate(self._handles):
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote_type = self._optional(
                        nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link
                    )
                    if remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                        switch[i] = switch.get(i, 0) + 1
                        continue
                    remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                except nvml.NVMLError_NotSupported:
                    break  # no NVLink on this GPU, or no more links
                except nvml.NVMLError:
                    continue
                j = by_bus.get(normalize_bus_id(remote.busId))
                if j is not None and j != i:
                    pairs[(i, j)] += 1
        return pairs, switch

    def topology(self) -> Topology:
        """PCIe common ancestor for every GPU pair, overridden by NVLink where links are up."""
        nvml = self._nvml
        pairs, switch = self._nvlinks()
        links = []
        n = len(self._handles)
        for i in range(n):
            for j in range(i + 1, n):
                a, b = f"cuda:{i}", f"cuda:{j}"
                count = pairs.get((i, j), 0) or pairs.get((j, i), 0)
                if not count and i in switch and j in switch:
                    count = min(switch[i], switch[j])
                if count:
                    links.append(Link(a, b, LinkKind.NVLINK, count))
                    continue
                try:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(
                        self._handles[i], self._handles[j]
                    )
                except nvml.NVMLError as exc:
                    logger.info("topology %s-%s unknown: %s", a, b, exc)
                    continue
                links.append(Link(a, b, _LEVELS.get(int(level), LinkKind.UNKNOWN)))
        return Topology.from_links(links)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        nvml = self._nvml
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
        except (nvml.NVMLError, AttributeError):
            pass
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            logger.warning("nvmlShutdown failed: %s", exc)

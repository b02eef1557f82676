"""Host memory as a device: psutil, bounded by the cgroup memory limit when one is set.

In a container the host's free memory is a lie: the kernel kills the process
at the cgroup limit. So the ``cpu`` device's total is ``min(host, limit)`` and
its used memory is the cgroup's *working set* (usage minus inactive page
cache, as kubelet and ``docker stats`` count it), read at every level from the
process's own cgroup up to the root; the level with the least headroom wins.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import psutil

from quantroute.telemetry.stats import DeviceKind, DeviceStats
from quantroute.telemetry.topology import Topology

logger = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The binding cgroup memory limit: the level with the least headroom."""

    version: int
    path: Path
    limit_bytes: int
    usage_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.usage_bytes)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        logger.warning("unexpected content in %s: %r", path, text[:40])
        return None


def _read_stat(path: Path, *keys: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(maxsplit=1) for line in lines if " " in line)
    for key in keys:
        if key in values:
            try:
                return int(values[key])
            except ValueError:
                return 0
    return 0


def _own_cgroup(proc_cgroup: Path, version: int) -> str:
    """The process's cgroup path relative to the hierarchy's mount, ``""`` if unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if version == 2 and hierarchy == "0" and controllers == "":
            return path.strip("/")
        if version == 1 and "memory" in controllers.split(","):
            return path.strip("/")
    return ""


def _levels(base: Path, relative: str) -> list[Path]:
    """``base/relative`` and each ancestor up to ``base``; just ``base`` when the
    relative path is not visible (a container without a cgroup namespace)."""
    own = base / relative if relative else base
    if not own.is_dir():
        return [base]
    levels = [own]
    while levels[-1] != base and base in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def read_cgroup_memory(
    cgroup_root: Path = DEFAULT_CGROUP_ROOT,
    proc_cgroup: Path = DEFAULT_PROC_CGROUP,
) -> CgroupMemory | None:
    """The tightest memory limit on this process, or ``None`` when no limit is set.

    cgroup v2: ``memory.max`` (``"max"`` = none) and ``memory.current``;
    cgroup v1: ``memory/memory.limit_in_bytes`` (≥ 2**62 = none) and
    ``memory.usage_in_bytes``. Usage excludes ``inactive_file`` page cache.
    """
    if (cgroup_root / "cgroup.controllers").exists():
        version, base = 2, cgroup_root
        limit_file, usage_file = "memory.max", "memory.current"
        stat_keys: tuple[str, ...] = ("inactive_file",)
    elif (cgroup_root / "memory" / "memory.limit_in_bytes").exists() or (
        cgroup_root / "memory.limit_in_bytes"
    ).exists():
        version = 1
        base = cgroup_root / "memory" if (cgroup_root / "memory").is_dir() else cgroup_root
        limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        stat_keys = ("total_inactive_file", "inactive_file")
    else:
        return None
    best: CgroupMemory | None = None
    for level in _levels(base, _own_cgroup(proc_cgroup, version)):
        limit = _read_int(level / limit_file)
        if limit is None or (version == 1 and limit >= _V1_UNLIMITED):
            continue
        usage = _read_int(level / usage_file) or 0
        inactive = _read_stat(level / "memory.stat", *stat_keys)
        found = CgroupMemory(version, level, limit, max(0, usage - inactive))
        if best is None or found.headroom_bytes < best.headroom_bytes:
            best = found
    return best


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


class CpuProvider:
    """The host as one device, ``cpu``: RAM from psutil, bounded by the cgroup limit.

    ``cgroup_root`` and ``proc_cgroup`` are injectable so tests read a fake
    cgroup tree made of real files.
    """

    def __init__(
        self,
        *,
        cgroup_root: Path = DEFAULT_CGROUP_ROOT,
        proc_cgroup: Path = DEFAULT_PROC_CGROUP,
    ) -> None:
        self._cgroup_root = cgroup_root
        self._proc_cgroup = proc_cgroup
        self._model = cpu_model()
        self._n_cpus = len(os.sched_getaffinity(0))
        psutil.cpu_percent(interval=None)  # prime: the first call has nothing to compare with

    @property
    def name(self) -> str:
        return "cpu"

    def read(self) -> list[DeviceStats]:
        vm = psutil.virtual_memory()
        total, used, free = int(vm.total), int(vm.total - vm.available), int(vm.available)
        detail = None
        cgroup = read_cgroup_memory(self._cgroup_root, self._proc_cgroup)
        if cgroup is not None and cgroup.limit_bytes < vm.total:
            total = cgroup.limit_bytes
            used = min(cgroup.usage_bytes, total)
            free = min(int(vm.available), cgroup.headroom_bytes)
            detail = f"cgroup v{cgroup.version} limit at {cgroup.path}"
        utilization = min(1.0, max(0.0, psutil.cpu_percent(interval=None) / 100.0))
        return [
            DeviceStats(
                id="cpu",
                kind=DeviceKind.CPU,
                name=f"{self._model} ({self._n_cpus} cpus)",
                total_bytes=total,
                used_bytes=used,
                free_bytes=free,
                utilization=utilization,
                detail=detail,
            )
        ]

    def topology(self) -> Topology:
        return Topology()

    def close(self) -> None:
        pass

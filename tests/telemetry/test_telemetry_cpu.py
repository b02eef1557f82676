"""The cpu device on fake cgroup trees made of real files."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from quantroute.telemetry import CpuProvider, DeviceKind, read_cgroup_memory

MiB = 1 << 20
V1_UNLIMITED = "9223372036854771712"


def write(root: Path, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content + "\n")


def proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("files", "self_cgroup", "expected"),
    [
        # cgroup v2, limit on the root of the namespace
        (
            {
                "cgroup.controllers": "cpu io memory pids",
                "memory.max": str(512 * MiB),
                "memory.current": str(200 * MiB),
                "memory.stat": f"anon {150 * MiB}\nfile {50 * MiB}\ninactive_file {40 * MiB}",
            },
            "0::/\n",
            (2, 512 * MiB, 160 * MiB),
        ),
        # cgroup v2, "max" means no limit
        (
            {"cgroup.controllers": "memory", "memory.max": "max", "memory.current": "1000"},
            "0::/\n",
            None,
        ),
        # cgroup v2, nested: the parent's limit is tighter than the process's own
        (
            {
                "cgroup.controllers": "memory",
                "kubepods/memory.max": str(1024 * MiB),
                "kubepods/memory.current": str(900 * MiB),
                "kubepods/pod1/memory.max": str(768 * MiB),
                "kubepods/pod1/memory.current": str(300 * MiB),
            },
            "0::/kubepods/pod1\n",
            (2, 1024 * MiB, 900 * MiB),
        ),
        # cgroup v1 under memory/, hierarchical inactive file pages subtracted
        (
            {
                "memory/memory.limit_in_bytes": str(2048 * MiB),
                "memory/memory.usage_in_bytes": str(1000 * MiB),
                "memory/memory.stat": f"inactive_file {1 * MiB}\ntotal_inactive_file {100 * MiB}",
            },
            "4:memory:/\n0::/\n",
            (1, 2048 * MiB, 900 * MiB),
        ),
        # cgroup v1 "unlimited" is PAGE_COUNTER_MAX
        (
            {
                "memory/memory.limit_in_bytes": V1_UNLIMITED,
                "memory/memory.usage_in_bytes": str(1000 * MiB),
            },
            "4:memory:/\n",
            None,
        ),
        # cgroup v1, the process's own cgroup (like this machine's /process_api/...) has the limit
        (
            {
                "memory/memory.limit_in_bytes": V1_UNLIMITED,
                "memory/memory.usage_in_bytes": str(5000 * MiB),
                "memory/job/abc/memory.limit_in_bytes": str(300 * MiB),
                "memory/job/abc/memory.usage_in_bytes": str(100 * MiB),
            },
            "9:name=systemd:/\n4:memory:/job/abc\n",
            (1, 300 * MiB, 100 * MiB),
        ),
        # nothing mounted
        ({}, "", None),
    ],
)
def test_read_cgroup_memory(
    tmp_path: Path,
    files: dict[str, str],
    self_cgroup: str,
    expected: tuple[int, int, int] | None,
) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    write(root, files)
    found = read_cgroup_memory(root, proc_cgroup(tmp_path, self_cgroup))
    if expected is None:
        assert found is None
    else:
        assert found is not None
        assert (found.version, found.limit_bytes, found.usage_bytes) == expected


def test_cpu_device_is_bounded_by_the_cgroup_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    write(
        root,
        {
            "cgroup.controllers": "memory",
            "memory.max": str(256 * MiB),
            "memory.current": str(100 * MiB),
        },
    )
    provider = CpuProvider(cgroup_root=root, proc_cgroup=proc_cgroup(tmp_path, "0::/\n"))
    (cpu,) = provider.read()
    assert (cpu.id, cpu.kind) == ("cpu", DeviceKind.CPU)
    assert (cpu.total_bytes, cpu.used_bytes) == (256 * MiB, 100 * MiB)
    assert cpu.free_bytes == min(156 * MiB, psutil.virtual_memory().available)
    assert cpu.detail is not None and "cgroup v2" in cpu.detail
    assert cpu.utilization is not None and 0.0 <= cpu.utilization <= 1.0


def test_cpu_device_without_limit_is_the_host(tmp_path: Path) -> None:
    provider = CpuProvider(cgroup_root=tmp_path / "none", proc_cgroup=tmp_path / "none")
    (cpu,) = provider.read()
    vm = psutil.virtual_memory()
    assert cpu.total_bytes == vm.total
    assert abs(cpu.free_bytes - vm.available) < 256 * MiB  # memory moves between two reads
    assert cpu.detail is None
    assert len(provider.topology()) == 0


def test_limit_above_host_memory_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    huge = psutil.virtual_memory().total * 4
    write(root, {"cgroup.controllers": "memory", "memory.max": str(huge), "memory.current": "0"})
    (cpu,) = CpuProvider(cgroup_root=root, proc_cgroup=proc_cgroup(tmp_path, "0::/\n")).read()
    assert cpu.total_bytes == psutil.virtual_memory().total

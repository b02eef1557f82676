"""Simulated devices: specs, attach/detach, pressure (set and from a file), thread safety."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from quantroute.telemetry import DeviceError, LinkKind, SimDeviceProvider, parse_sim_spec

GiB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize(
    ("spec", "totals"),
    [
        ("sim:2x24GiB", (24 * GiB, 24 * GiB)),
        ("sim:1x8GiB,1x16GiB", (8 * GiB, 16 * GiB)),
        ("sim:3x512MiB", (512 * MiB,) * 3),
        ("sim:1x1.5GiB", (1536 * MiB,)),
        ("sim:1x8GB", (8_000_000_000,)),
    ],
)
def test_spec_totals(spec: str, totals: tuple[int, ...]) -> None:
    assert parse_sim_spec(spec).totals == totals


@pytest.mark.parametrize(
    "spec",
    [
        "sim:",
        "2x24GiB",
        "sim:0x24GiB",
        "sim:2x24Gib!",
        "sim:2x",
        "sim:2x1GiB;nvlink=0-2",
        "sim:2x1GiB;nvlink=1-1",
        "sim:2x1GiB;default=warp",
        "sim:2x1GiB;color=red",
    ],
)
def test_bad_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_sim_spec(spec)


def test_spec_topology() -> None:
    topo = parse_sim_spec("sim:4x80GiB;nvlink=0-1,3-2;default=sys").topology
    assert topo.link("sim:0", "sim:1") is LinkKind.NVLINK
    assert topo.link("sim:2", "sim:3") is LinkKind.NVLINK
    assert topo.link("sim:1", "sim:2") is LinkKind.SYS
    assert parse_sim_spec("sim:2x1GiB").topology.link("sim:0", "sim:1") is LinkKind.PHB


def test_attach_detach_move_used_memory() -> None:
    sim = SimDeviceProvider.from_spec("sim:2x8GiB")
    sim.attach("sim:0", "tiny:f16", 3 * GiB)
    sim.attach("sim:0", "tiny:q8_0", 1 * GiB)
    sim.attach("sim:1", "tiny:q4", 2 * GiB)
    d0, d1 = sim.read()
    assert (d0.used_bytes, d0.free_bytes) == (4 * GiB, 4 * GiB)
    assert (d1.used_bytes, d1.free_bytes) == (2 * GiB, 6 * GiB)
    sim.attach("sim:0", "tiny:f16", 2 * GiB)  # measured footprint replaces the estimate
    sim.detach("sim:0", "tiny:q8_0")
    sim.detach("sim:0", "never-attached")
    assert sim.read()[0].used_bytes == 2 * GiB
    assert sim.attached("sim:0") == {"tiny:f16": 2 * GiB}


def test_unknown_device_and_negative_bytes_are_errors() -> None:
    sim = SimDeviceProvider.from_spec("sim:1x1GiB")
    with pytest.raises(KeyError, match="sim:7"):
        sim.attach("sim:7", "x", 1)
    with pytest.raises(ValueError):
        sim.attach("sim:0", "x", -1)
    with pytest.raises(ValueError):
        sim.set_pressure("sim:0", -1)


def test_pressure_adds_and_overcommit_clamps_free_at_zero() -> None:
    sim = SimDeviceProvider.from_spec("sim:1x4GiB")
    sim.attach("sim:0", "b", 3 * GiB)
    sim.set_pressure("sim:0", 2 * GiB)
    (d,) = sim.read()
    assert (d.used_bytes, d.free_bytes, d.detail) == (5 * GiB, 0, "over-committed")


def test_pressure_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "pressure.json"
    sim = SimDeviceProvider.from_spec("sim:2x8GiB", pressure_file=path)
    assert [d.used_bytes for d in sim.read()] == [0, 0]  # no file yet: no pressure

    path.write_text(json.dumps({"sim:1": "3GiB"}))
    assert [d.used_bytes for d in sim.read()] == [0, 3 * GiB]

    path.write_text(json.dumps({"sim:0": 1024, "sim:1": "1GiB"}))
    os.utime(path, ns=(1, 1))  # a new mtime even on coarse-grained filesystems
    assert [d.used_bytes for d in sim.read()] == [1024, 1 * GiB]

    path.write_text("{not json")
    os.utime(path, ns=(2, 2))
    assert [d.used_bytes for d in sim.read()] == [1024, 1 * GiB]  # bad file: keep the last

    path.unlink()
    assert [d.used_bytes for d in sim.read()] == [0, 0]


def test_injected_faults_xid_health_and_failing_reads() -> None:
    sim = SimDeviceProvider.from_spec("sim:2x1GiB")
    sim.inject_xid("sim:1", 2)
    sim.set_healthy("sim:0", False)
    d0, d1 = sim.read()
    assert (d0.healthy, d1.xid_errors) == (False, 2)
    sim.fail_reads(2)
    for _ in range(2):
        with pytest.raises(DeviceError):
            sim.read()
    assert len(sim.read()) == 2
    sim.close()
    with pytest.raises(DeviceError, match="closed"):
        sim.read()


def test_concurrent_attach_detach_and_read_stay_consistent() -> None:
    sim = SimDeviceProvider.from_spec("sim:1x64GiB")
    errors: list[str] = []

    def churn(worker: int) -> None:
        for i in range(300):
            sim.attach("sim:0", f"w{worker}-{i}", 1 * MiB)
            sim.detach("sim:0", f"w{worker}-{i}")
        sim.attach("sim:0", f"w{worker}-final", 1 * MiB)

    def watch() -> None:
        for _ in range(300):
            (d,) = sim.read()
            if d.used_bytes % MiB or d.used_bytes + d.free_bytes != 64 * GiB:
                errors.append(f"torn read {d}")

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sim.read()[0].used_bytes == 4 * MiB

"""Placement: most headroom x health, NVLink-near pairs for spanning branches."""

from __future__ import annotations

import pytest

from quantroute.telemetry import (
    DeviceKind,
    DeviceStats,
    Footprint,
    InsufficientMemoryError,
    Link,
    LinkKind,
    MarginPolicy,
    Topology,
    parse_topo_matrix,
    place,
)

GiB = 1 << 30
NO_MARGIN = MarginPolicy(min_bytes=0, fraction=0.0)


def dev(
    device_id: str,
    free_gib: float,
    total_gib: float = 80,
    *,
    kind: DeviceKind = DeviceKind.CUDA,
    healthy: bool = True,
) -> DeviceStats:
    free, total = int(free_gib * GiB), int(total_gib * GiB)
    return DeviceStats(device_id, kind, "d", total, total - free, free, healthy=healthy)


# (free GiB per cuda:i, health, need GiB, expected choice)
SINGLE = [
    ([10, 40, 20], {}, 5, ("cuda:1",)),
    ([10, 40, 40], {}, 5, ("cuda:1",)),  # tie: lower id
    ([10, 40, 20], {"cuda:1": 0.2}, 5, ("cuda:2",)),  # 35 x 0.2 < 15 x 1
    ([10, 40, 20], {"cuda:1": 0.0}, 5, ("cuda:2",)),  # health 0: never
    ([10, 40, 20], {}, 30, ("cuda:1",)),  # only one fits
    ([6, 4], {}, 5, ("cuda:0",)),
]


@pytest.mark.parametrize(("free", "health", "need", "expected"), SINGLE)
def test_single_device(
    free: list[float], health: dict[str, float], need: float, expected: tuple[str, ...]
) -> None:
    devices = [dev(f"cuda:{i}", f) for i, f in enumerate(free)]
    assert place(int(need * GiB), devices, Topology(), health, margin=NO_MARGIN) == expected


def test_margin_is_respected() -> None:
    # 5 % of 80 GiB = 4 GiB kept back: 6 GiB free leaves 2 GiB for the branch
    devices = [dev("cuda:0", 6)]
    assert place(2 * GiB, devices, Topology(), {}) == ("cuda:0",)
    with pytest.raises(InsufficientMemoryError, match=r"needs 2\.5 GiB.*2\.0 GiB on cuda:0"):
        place(int(2.5 * GiB), devices, Topology(), {})


def test_fragmentation_penalty_moves_the_choice() -> None:
    devices = [dev("cuda:0", 30), dev("cuda:1", 25)]
    margin = MarginPolicy(min_bytes=0, fraction=0.0, fragmentation_bytes={"cuda:0": 10 * GiB})
    assert place(GiB, devices, Topology(), {}, margin=margin) == ("cuda:1",)


def test_unhealthy_and_wrong_kind_devices_are_skipped() -> None:
    devices = [
        dev("cuda:0", 70, healthy=False),
        dev("cuda:1", 10),
        dev("cpu", 60, kind=DeviceKind.CPU),
    ]
    assert place(GiB, devices, Topology(), {}, margin=NO_MARGIN) == ("cpu",)
    assert place(GiB, devices, Topology(), {}, kinds={DeviceKind.CUDA}, margin=NO_MARGIN) == (
        "cuda:1",
    )
    with pytest.raises(InsufficientMemoryError, match="no healthy device"):
        place(GiB, devices, Topology(), {}, kinds={DeviceKind.SIM})


def test_footprint_records_use_their_per_device_share() -> None:
    fp = Footprint(weights_bytes=30 * GiB, kv_bytes=10 * GiB, compute_bytes=GiB, overhead_bytes=0)
    devices = [dev("cuda:0", 25), dev("cuda:1", 25)]
    topo = Topology.from_links([Link("cuda:0", "cuda:1", LinkKind.PHB)])
    with pytest.raises(InsufficientMemoryError):
        place(fp, devices, topo, {}, margin=NO_MARGIN)
    assert place(fp, devices, topo, {}, span=2, margin=NO_MARGIN) == ("cuda:0", "cuda:1")


def test_span_two_prefers_nvlink_pairs_over_headroom() -> None:
    # 4 GPUs: NV4 between 0-1, PIX 1-2, SYS to 3 (recorded nvidia-smi topo -m output)
    from pathlib import Path

    topo = parse_topo_matrix(
        (Path(__file__).parent / "data" / "smi_topo_4gpu_mixed.txt").read_text()
    )
    devices = [dev("cuda:0", 30), dev("cuda:1", 30), dev("cuda:2", 70), dev("cuda:3", 70)]
    assert place(20 * GiB, devices, topo, {}, span=2, margin=NO_MARGIN) == ("cuda:0", "cuda:1")
    # cuda:0 too full for its half: the next nearest pair with room is PIX 1-2
    devices[0] = dev("cuda:0", 5)
    assert place(20 * GiB, devices, topo, {}, span=2, margin=NO_MARGIN) == ("cuda:1", "cuda:2")


def test_span_two_prefers_more_nvlinks_then_headroom() -> None:
    topo = Topology.from_links(
        [
            Link("cuda:0", "cuda:1", LinkKind.NVLINK, 2),
            Link("cuda:2", "cuda:3", LinkKind.NVLINK, 4),
            Link("cuda:0", "cuda:2", LinkKind.SYS),
        ]
    )
    devices = [dev(f"cuda:{i}", f) for i, f in enumerate([70, 70, 20, 20])]
    assert place(10 * GiB, devices, topo, {}, span=2, margin=NO_MARGIN) == ("cuda:2", "cuda:3")
    with pytest.raises(ValueError):
        place(GiB, devices, topo, {}, span=3)


def test_span_two_needs_two_devices_that_fit() -> None:
    with pytest.raises(InsufficientMemoryError, match="two devices"):
        place(
            10 * GiB,
            [dev("cuda:0", 70), dev("cuda:1", 1)],
            Topology(),
            {},
            span=2,
            margin=NO_MARGIN,
        )

"""Where a branch should load: the device with the most headroom * health.

``headroom = free_for_routing - bytes the branch needs there``. A device that
cannot hold the branch, is unhealthy or has health 0 is never chosen. A
branch that spans two devices (weights and KV split, buffers on both) goes to
the pair with the nearest link (NVLink first, more links better, then PIX,
PXB, ...), ties broken by the smaller of the two scores, then by id.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from quantroute.telemetry.memory import Footprint, MiB, free_for_routing, safety_margin_bytes
from quantroute.telemetry.stats import DeviceKind, DeviceStats, InsufficientMemoryError
from quantroute.telemetry.topology import Topology
from quantroute.telemetry.units import format_bytes


@dataclass(frozen=True, slots=True)
class MarginPolicy:
    """The safety margin and fragmentation penalties placement subtracts from free memory."""

    min_bytes: int = 128 * MiB
    fraction: float = 0.05
    fragmentation_bytes: Mapping[str, int] | None = None

    def balance(self, device: DeviceStats) -> int:
        """Like :meth:`headroom`, but negative by how far a device is over its budget
        (the residency manager unloads until it is not)."""
        frag = (self.fragmentation_bytes or {}).get(device.id, 0)
        margin = safety_margin_bytes(
            device.total_bytes, min_bytes=self.min_bytes, fraction=self.fraction
        )
        return device.free_bytes - margin - max(0, frag)

    def headroom(self, device: DeviceStats) -> int:
        frag = (self.fragmentation_bytes or {}).get(device.id, 0)
        return free_for_routing(
            device,
            fragmentation_bytes=frag,
            min_margin_bytes=self.min_bytes,
            margin_fraction=self.fraction,
        )


def place(
    footprint: Footprint | int,
    devices: Sequence[DeviceStats],
    topology: Topology,
    health: Mapping[str, float],
    *,
    span: int = 1,
    kinds: Collection[DeviceKind] | None = None,
    margin: MarginPolicy | None = None,
) -> tuple[str, ...]:
    """Pick ``span`` (1 or 2) device ids for a branch of ``footprint`` bytes.

    ``health`` maps device id → factor in [0, 1] (missing = 1), as
    :meth:`HealthTracker.factors` returns. ``kinds`` restricts the candidates
    (a llama.cpp CPU branch: ``{DeviceKind.CPU}``). Raises
    :class:`InsufficientMemoryError` when nothing fits.

    >>> from quantroute.telemetry.stats import DeviceStats, DeviceKind
    >>> gib = 1 << 30
    >>> devs = [DeviceStats(f"sim:{i}", DeviceKind.SIM, "sim", 8 * gib, u * gib, (8 - u) * gib)
    ...         for i, u in enumerate([6, 1])]
    >>> place(2 * gib, devs, Topology(), {})
    ('sim:1',)
    """
    if span not in (1, 2):
        raise ValueError(f"span must be 1 or 2, got {span}")
    margin = margin or MarginPolicy()
    if isinstance(footprint, Footprint):
        need = footprint.per_device(span)
    else:
        need = footprint if span == 1 else -(-footprint // span)
    candidates = sorted(
        (
            d
            for d in devices
            if d.healthy and (kinds is None or d.kind in kinds) and health.get(d.id, 1.0) > 0
        ),
        key=lambda d: _natural(d.id),
    )
    score: dict[str, float] = {}
    for device in candidates:
        left = margin.headroom(device) - need
        if left >= 0:
            score[device.id] = left * health.get(device.id, 1.0)
    if span == 1:
        if not score:
            raise _nothing_fits(need, candidates, margin)
        return (max(score, key=score.__getitem__),)  # first maximum: the lowest id wins ties
    fitting = [d for d in candidates if d.id in score]
    pairs = [(a.id, b.id) for a, b in combinations(fitting, 2) if a.kind == b.kind]
    if not pairs:
        raise _nothing_fits(need, candidates, margin, span=2)

    def rank(pair: tuple[str, str]) -> tuple[int, int, float]:
        a, b = pair
        return (-topology.link(a, b).rank, topology.nvlinks(a, b), min(score[a], score[b]))

    return max(pairs, key=rank)


def _natural(device_id: str) -> tuple[str, int]:
    """``cuda:2`` before ``cuda:10``."""
    prefix, _, number = device_id.rpartition(":")
    return (prefix, int(number)) if number.isdigit() else (device_id, -1)


def _nothing_fits(
    need: int, candidates: Sequence[DeviceStats], margin: MarginPolicy, *, span: int = 1
) -> InsufficientMemoryError:
    if not candidates:
        return InsufficientMemoryError("no healthy device of a suitable kind to place a branch on")
    best = max(candidates, key=margin.headroom)
    where = "any device" if span == 1 else "two devices of one kind"
    return InsufficientMemoryError(
        f"branch needs {format_bytes(need)} on {where}; the most headroom is "
        f"{format_bytes(margin.headroom(best))} on {best.id}"
    )

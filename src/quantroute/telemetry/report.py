"""Snapshots rendered for people and programs: ``GET /v1/devices`` and ``quantroute devices``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.telemetry.stats import DeviceStats
from quantroute.telemetry.units import format_bytes


def _device_json(
    device: DeviceStats,
    branches: Sequence[str],
    health: float | None,
    margin: MarginPolicy,
) -> dict[str, Any]:
    return {
        "id": device.id,
        "kind": str(device.kind),
        "name": device.name,
        "uuid": device.uuid,
        "healthy": device.healthy,
        "health_factor": health,
        "memory": {
            "total_bytes": device.total_bytes,
            "used_bytes": device.used_bytes,
            "free_bytes": device.free_bytes,
            "free_for_routing_bytes": margin.headroom(device),
        },
        "utilization": device.utilization,
        "temperature_c": device.temperature_c,
        "power_w": device.power_w,
        "sm_clock_mhz": device.sm_clock_mhz,
        "ecc_errors": device.ecc_errors,
        "xid_errors": device.xid_errors,
        "processes": [
            {"pid": p.pid, "used_bytes": p.used_bytes, "name": p.name} for p in device.processes
        ],
        "mig": [
            {
                "index": m.index,
                "gpu_instance_id": m.gpu_instance_id,
                "compute_instance_id": m.compute_instance_id,
                "total_bytes": m.total_bytes,
                "used_bytes": m.used_bytes,
                "free_bytes": m.free_bytes,
            }
            for m in device.mig
        ],
        "branches": list(branches),
        "detail": device.detail,
    }


def snapshot_to_json(
    snapshot: DeviceSnapshot,
    branches_view: Mapping[str, Sequence[str]] | None = None,
    *,
    health: Mapping[str, float] | None = None,
    margin: MarginPolicy | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """A JSON-ready dict: devices, the branches loaded on each (``branches_view``: device id →
    branch names), health factors, topology links, and the snapshot's age and staleness."""
    age = snapshot.age_s(now)
    margin = margin or MarginPolicy()
    views = branches_view or {}
    return {
        "object": "list",
        "provider": snapshot.provider,
        "age_s": None if math.isinf(age) else round(age, 3),
        "stale": snapshot.is_stale(now),
        "last_error": snapshot.last_error,
        "data": [
            _device_json(
                d, views.get(d.id, ()), None if health is None else health.get(d.id, 1.0), margin
            )
            for d in snapshot.devices
        ],
        "topology": [
            {"a": link.a, "b": link.b, "link": str(link.kind), "nvlinks": link.nvlinks}
            for link in snapshot.topology
        ],
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(
    snapshot: DeviceSnapshot,
    *,
    health: Mapping[str, float] | None = None,
    now: float | None = None,
) -> str:
    """A fixed-width table of the snapshot, then the GPU link matrix when there are links.

    ::

        ID      KIND  NAME                   USED / TOTAL        FREE      UTIL  TEMP  POWER  HEALTH
        cuda:0  cuda  NVIDIA A100-SXM4-80GB  4.0 MiB / 80.0 GiB  79.2 GiB  0%    31C   62W    ok
    """
    header = ("ID", "KIND", "NAME", "USED / TOTAL", "FREE", "UTIL", "TEMP", "POWER", "HEALTH")
    rows = [header]
    for d in snapshot.devices:
        factor = None if health is None else health.get(d.id, 1.0)
        state = "ok" if d.healthy else "UNHEALTHY"
        if factor is not None and d.healthy:
            state = f"{factor:.2f}"
        rows.append(
            (
                d.id,
                str(d.kind),
                d.name if len(d.name) <= 28 else d.name[:27] + "…",
                f"{format_bytes(d.used_bytes)} / {format_bytes(d.total_bytes)}",
                format_bytes(d.free_bytes),
                "-" if d.utilization is None else f"{d.utilization:.0%}",
                _cell(d.temperature_c, ".0f") + ("C" if d.temperature_c is not None else ""),
                _cell(d.power_w, ".0f") + ("W" if d.power_w is not None else ""),
                state,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    age = snapshot.age_s(now)
    status = "no reading yet" if math.isinf(age) else f"read {age:.1f} s ago"
    if snapshot.is_stale(now):
        status += " (STALE)"
    if snapshot.last_error:
        status += f"; last error: {snapshot.last_error}"
    lines.append(f"provider {snapshot.provider or '-'}, {status}")
    ids = snapshot.topology.devices()
    if ids:
        lines.append("")
        width = max(len(i) for i in ids) + 2
        lines.append(" " * width + "".join(i.ljust(width) for i in ids).rstrip())
        for a in ids:
            cells = []
            for b in ids:
                kind = snapshot.topology.link(a, b)
                nv = snapshot.topology.nvlinks(a, b)
                label = "X" if a == b else (f"NV{nv}" if nv else str(kind).upper())
                cells.append(label.ljust(width))
            lines.append(a.ljust(width) + "".join(cells).rstrip())
    return "\n".join(lines)

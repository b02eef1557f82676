"""Rendering snapshots: JSON for GET /v1/devices, a table for `quantroute devices`."""

from __future__ import annotations

import json
from pathlib import Path

from quantroute.telemetry import (
    DeviceSnapshot,
    format_table,
    parse_query_xml,
    parse_topo_matrix,
    snapshot_to_json,
)

DATA = Path(__file__).parent / "data"
MiB = 1 << 20


def eight_gpus(taken_at: float | None = 100.0) -> DeviceSnapshot:
    return DeviceSnapshot(
        taken_at=taken_at,
        devices=tuple(parse_query_xml((DATA / "smi_q_8xh100.xml").read_text())),
        topology=parse_topo_matrix((DATA / "smi_topo_8gpu_nvswitch.txt").read_text()),
        stale_after_s=3.0,
        provider="nvidia-smi",
    )


def test_snapshot_to_json_is_serialisable_and_complete() -> None:
    body = snapshot_to_json(
        eight_gpus(), {"cuda:0": ["tiny-llama:f16"]}, health={"cuda:4": 0.5}, now=101.25
    )
    json.dumps(body)  # plain JSON types only
    assert (body["provider"], body["age_s"], body["stale"]) == ("nvidia-smi", 1.25, False)
    first, fifth = body["data"][0], body["data"][4]
    assert first["id"] == "cuda:0" and first["branches"] == ["tiny-llama:f16"]
    assert first["memory"]["used_bytes"] == 71234 * MiB
    assert first["memory"]["free_for_routing_bytes"] < first["memory"]["free_bytes"]
    assert first["processes"] == [
        {"pid": 70100, "used_bytes": 71228 * MiB, "name": "/opt/venv/bin/python3"}
    ]
    assert (first["health_factor"], fifth["health_factor"]) == (1.0, 0.5)
    assert body["data"][1]["branches"] == []
    assert len(body["topology"]) == 28
    assert body["topology"][0] == {"a": "cuda:0", "b": "cuda:1", "link": "nvlink", "nvlinks": 18}


def test_snapshot_to_json_before_the_first_reading() -> None:
    body = snapshot_to_json(DeviceSnapshot(taken_at=None))
    assert body["age_s"] is None and body["stale"] is True and body["data"] == []


def test_format_table_lists_every_device_and_the_link_matrix() -> None:
    text = format_table(eight_gpus(), health={"cuda:0": 0.25}, now=110.0)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["ID", "KIND", "NAME"]
    assert lines[1].startswith("cuda:0") and "69.6 GiB / 79.6 GiB" in lines[1]
    assert lines[1].rstrip().endswith("0.25") and "98%" in lines[1] and "612W" in lines[1]
    assert "provider nvidia-smi, read 10.0 s ago (STALE)" in text
    matrix = lines[lines.index("") + 1 :]
    assert matrix[0].split() == [f"cuda:{i}" for i in range(8)]
    assert matrix[1].split() == ["cuda:0", "X"] + ["NV18"] * 7


def test_format_table_marks_unhealthy_devices_and_errors() -> None:
    from dataclasses import replace

    snap = eight_gpus()
    broken = replace(snap.devices[2], healthy=False)
    snap = replace(snap, devices=(snap.devices[0], broken), last_error="DeviceError: boom")
    text = format_table(snap, now=100.5)
    assert "UNHEALTHY" in text.splitlines()[2]
    assert "last error: DeviceError: boom" in text

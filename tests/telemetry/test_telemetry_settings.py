"""TelemetrySettings: defaults, bounds, provider strings, and its independence of quantroute."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from quantroute.telemetry import TelemetrySettings


def test_defaults() -> None:
    s = TelemetrySettings()
    assert (s.devices, s.poll_interval_s, s.stale_after_intervals) == ("auto", 1.0, 3)
    assert (s.safety_margin_min_bytes, s.safety_margin_fraction) == (128 << 20, 0.05)
    assert s.pressure_file is None and s.cpu_affinity is None


@pytest.mark.parametrize(
    "devices",
    [
        "auto",
        "nvml",
        "nvidia-smi",
        "cpu",
        "sim:2x24GiB",
        "sim:1x8GiB,1x16GiB",
        "nvml+cpu",
        "sim:2x8GiB;nvlink=0-1+cpu",
    ],
)
def test_accepted_provider_strings(devices: str) -> None:
    assert TelemetrySettings(devices=devices).devices == devices


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("devices", "rocm"),
        ("devices", "auto+cpu"),
        ("devices", "sim"),
        ("poll_interval_s", 0.1),
        ("stale_after_intervals", 0),
        ("safety_margin_fraction", 1.5),
        ("cpu_affinity", [[0, 1], []]),
        ("unknown_field", 1),
    ],
)
def test_rejected_values(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        TelemetrySettings(**{field: value})


def test_lives_in_the_settings_tree() -> None:
    from quantroute.config import Settings

    assert Settings.model_fields["telemetry"].annotation is TelemetrySettings


def test_every_field_is_described() -> None:
    for name, info in TelemetrySettings.model_fields.items():
        assert info.description, name

"""Choosing providers from configuration strings, auto-detection, composites."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from quantroute.errors import ConfigError
from quantroute.telemetry import (
    CommandResult,
    CompositeProvider,
    CpuProvider,
    DeviceError,
    SimDeviceProvider,
    SmiProvider,
    TelemetrySettings,
    health_from_settings,
    margin_from_settings,
    open_provider,
    poller_from_settings,
    provider_from_settings,
)

DATA = Path(__file__).parent / "data"


def recorded(name: str, returncode: int = 0) -> Any:
    def run(argv: Sequence[str], timeout_s: float) -> CommandResult:
        args = " ".join(argv[1:])
        if args.startswith("--query-gpu"):
            return CommandResult(returncode, (DATA / name).read_text())
        if args == "-q -x":
            return CommandResult(returncode, (DATA / "smi_q_2x3090.xml").read_text())
        return CommandResult(returncode, (DATA / "smi_topo_2gpu_phb.txt").read_text())

    return run


def test_auto_without_gpu_here_is_the_cpu_alone() -> None:
    provider = open_provider("auto", smi_binary="nvidia-smi-not-installed")
    assert isinstance(provider, CpuProvider)
    assert [d.id for d in provider.read()] == ["cpu"]


def test_auto_prefers_nvml_and_adds_the_cpu(nvml_kit: Any) -> None:
    provider = open_provider("auto", nvml_module=nvml_kit.Nvml([nvml_kit.Gpu()]))
    assert isinstance(provider, CompositeProvider) and provider.name == "nvml+cpu"
    assert [d.id for d in provider.read()] == ["cuda:0", "cpu"]
    provider.close()


def test_auto_falls_back_to_nvidia_smi_when_nvml_fails(nvml_kit: Any) -> None:
    import pynvml

    broken = nvml_kit.Nvml([])
    broken.fail_init = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    provider = open_provider("auto", nvml_module=broken, smi_runner=recorded("smi_query_2gpu.csv"))
    assert provider.name == "nvidia-smi+cpu"
    assert [d.id for d in provider.read()] == ["cuda:0", "cuda:1", "cpu"]
    assert provider.topology().link("cuda:0", "cuda:1") == "phb"


def test_auto_skips_an_nvidia_smi_that_cannot_reach_the_driver() -> None:
    provider = open_provider("auto", smi_runner=recorded("smi_driver_failure.txt", 9))
    assert isinstance(provider, CpuProvider)


def test_explicit_names(tmp_path: Path) -> None:
    assert isinstance(open_provider("cpu"), CpuProvider)
    assert isinstance(
        open_provider("nvidia-smi", smi_runner=recorded("smi_query_1gpu.csv")), SmiProvider
    )
    sim = open_provider("sim:1x8GiB,1x16GiB", pressure_file=tmp_path / "p.json")
    assert isinstance(sim, SimDeviceProvider) and [d.total_bytes >> 30 for d in sim.read()] == [
        8,
        16,
    ]
    both = open_provider("sim:2x1GiB+cpu")
    assert [d.id for d in both.read()] == ["sim:0", "sim:1", "cpu"]


def test_explicit_nvml_without_gpu_fails_loudly() -> None:
    with pytest.raises(DeviceError, match="NVML failed to initialise"):
        open_provider("nvml")


@pytest.mark.parametrize("spec", ["rocm", "sim:banana", "cpu+tpu"])
def test_unknown_specs(spec: str) -> None:
    with pytest.raises(ConfigError):
        open_provider(spec)


def test_composite_refuses_duplicate_ids() -> None:
    provider = CompositeProvider([CpuProvider(), CpuProvider()])
    with pytest.raises(DeviceError, match="duplicate"):
        provider.read()


def test_from_settings(tmp_path: Path) -> None:
    settings = TelemetrySettings(devices="sim:2x4GiB", pressure_file=tmp_path / "pressure.json")
    (tmp_path / "pressure.json").write_text('{"sim:1": "1GiB"}')
    provider = provider_from_settings(settings)
    assert [d.used_bytes >> 30 for d in provider.read()] == [0, 1]
    poller = poller_from_settings(provider, settings.model_copy(update={"poll_interval_s": 2.0}))
    assert poller.interval_s == 2.0 and poller.snapshot.stale_after_s == 6.0
    health = health_from_settings(settings.model_copy(update={"health_lambda": 2.0}))
    health.record_failure("sim:0", "crash")
    assert health.factor("sim:0") == pytest.approx(0.1353, abs=1e-4)
    margin = margin_from_settings(settings, {"sim:0": 1 << 30})
    assert margin.fragmentation_bytes == {"sim:0": 1 << 30} and margin.fraction == 0.05

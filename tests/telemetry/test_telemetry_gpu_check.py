"""scripts/gpu_check.sh: fails clearly without a GPU; its comparison logic on recorded data."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from quantroute.telemetry import parse_query_csv, parse_query_xml

ROOT = Path(__file__).parents[2]
DATA = Path(__file__).parent / "data"
MiB = 1 << 20


@functools.cache
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU is attached")
def test_without_a_gpu_it_exits_2_with_a_clear_message() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--nvidia-smi", "nvidia-smi-absent"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "FAIL: no NVIDIA GPU usable here: NVML failed to initialise" in done.stdout
    assert "nvidia-smi: not found on PATH" in done.stdout


def test_readings_that_agree_pass() -> None:
    check = gpu_check()
    csv = parse_query_csv((DATA / "smi_query_8gpu.csv").read_text())
    xml = parse_query_xml((DATA / "smi_q_8xh100.xml").read_text())
    findings = check.compare_readings(xml, csv)
    assert len(findings) == 16 and all(f.ok for f in findings)


def test_a_used_memory_mismatch_fails() -> None:
    check = gpu_check()
    csv = parse_query_csv((DATA / "smi_query_8gpu.csv").read_text())
    nvml = list(csv)
    nvml[3] = dataclasses.replace(nvml[3], used_bytes=nvml[3].used_bytes + 1000 * MiB)  # 1.2 %
    failed = [f.line for f in check.compare_readings(nvml, csv) if not f.ok]
    assert failed == ["cuda:3: used NVML 1004 MiB, nvidia-smi 4 MiB (1.23% of total)"]
    assert not all(f.ok for f in check.compare_readings(nvml[:7], csv))

"""``quantroute doctor``: the verdict on plain data, then the real command on the demo model."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from quantroute.cli import main
from quantroute.config import DEMO_REPO
from quantroute.doctor import (
    DoctorReport,
    PrecisionCheck,
    ScriptBuild,
    Toolchain,
    format_report,
    report_to_json,
)
from quantroute.engines.exits import describe_exit
from quantroute.engines.llamacpp.build import BuildInfo, BuildRecord, DecodeCheck
from quantroute.types import Precision

SIGILL_WORDS = describe_exit(-signal.SIGILL)
NO_GPU = Toolchain(smi=None, gpus=(), nvcc=None)
GPU_AND_NVCC = Toolchain(
    smi="/usr/bin/nvidia-smi", gpus=("GPU 0: NVIDIA H200 (UUID: GPU-1)",), nvcc="/usr/bin/nvcc"
)


def _build(
    *,
    backends: tuple[str, ...] = ("CPU",),
    missing: tuple[str, ...] = (),
    key: str | None = "k1",
) -> BuildInfo:
    compiled = ("SSE3", "AVX", "AVX2", "FMA", "F16C", "BMI2", *missing)
    return BuildInfo(
        llama_cpp_python="0.3.36",
        llama_version="0.5.0",
        ggml_version="0.25.3",
        ggml_commit="abc1234",
        system_info="CPU : " + " | ".join(f"{f} = 1" for f in compiled) + " |",
        backends=backends,
        gpu_offload="CUDA" in backends,
        cpu_features=compiled,
        machine_features=("SSE3", "AVX", "AVX2", "FMA", "F16C", "BMI2"),
        missing_features=missing,
        record=None
        if key is None
        else BuildRecord(
            "/v/llama-build.json", key, "cpu", "0.3.36", "w.whl", ("-DGGML_NATIVE=OFF",)
        ),
    )


def _check(precision: Precision, ok: bool = True) -> PrecisionCheck:
    detail = "decoded token 259 (' ') after a 17-token prompt" if ok else SIGILL_WORDS
    rc = 0 if ok else -signal.SIGILL
    check = DecodeCheck(f"/r/{precision}.gguf", ok, rc, detail, 0.25)
    return PrecisionCheck(precision, "tiny-llama", precision.value, check)


def _report(
    build: BuildInfo | None = None,
    *,
    toolchain: Toolchain = NO_GPU,
    script_key: str = "k1",
    checks: tuple[PrecisionCheck, ...] | None = None,
) -> DoctorReport:
    return DoctorReport(
        build=build,
        build_error=None if build else f"the llama.cpp build probe died: {SIGILL_WORDS}",
        toolchain=toolchain,
        script=ScriptBuild("scripts/llama_build.sh", toolchain.backend, script_key),
        devices=None,
        devices_error="no devices in this test",
        repo=Path("/r"),
        repo_problems=(),
        checks=(_check(Precision.F16), _check(Precision.Q8_0)) if checks is None else checks,
    )


@pytest.mark.parametrize(
    ("report", "ok", "says"),
    [
        (_report(_build()), True, "doctor: OK"),
        (_report(_build(missing=("AMX_INT8",))), False, "will die with SIGILL here"),
        (_report(None), False, "could not probe the build"),
        (
            _report(_build(), checks=(_check(Precision.F16), _check(Precision.Q8_0, ok=False))),
            False,
            "1 of 2 precision(s) failed",
        ),
        (_report(_build(), checks=()), False, "nothing to decode"),
    ],
)
def test_verdict(report: DoctorReport, ok: bool, says: str) -> None:
    assert report.ok is ok
    text = format_report(report)
    assert says in text
    assert text.splitlines()[-1].startswith("doctor: OK" if ok else "doctor: FAIL")
    assert report_to_json(report)["ok"] is ok


def test_missing_feature_line_names_them_and_the_way_out() -> None:
    text = format_report(_report(_build(missing=("AVX512", "AMX_INT8"))))
    line = next(line for line in text.splitlines() if "SIGILL" in line)
    assert "AVX512, AMX_INT8" in line
    assert "`make`" in line and "docs/troubleshooting.md#sigill" in line


@pytest.mark.parametrize(
    ("build", "toolchain", "script_key", "warning"),
    [
        (_build(), GPU_AND_NVCC, "k1", "this build has no CUDA backend"),
        (_build(backends=("CUDA", "CPU")), NO_GPU, "k1", "no GPU is visible"),
        (_build(), Toolchain("/usr/bin/nvidia-smi", ("GPU 0: X",), None), "k1", "no CUDA toolkit"),
        (_build(key=None), NO_GPU, "k1", "no build record"),
        (_build(key="old"), NO_GPU, "k1", "run `make` to rebuild"),
    ],
)
def test_warnings(build: BuildInfo, toolchain: Toolchain, script_key: str, warning: str) -> None:
    report = _report(build, toolchain=toolchain, script_key=script_key)
    assert any(warning in w for w in report.warnings), report.warnings
    assert report.ok  # a warning does not fail the check
    assert warning in format_report(report)


def test_a_matching_build_has_no_warnings() -> None:
    assert _report(_build()).warnings == ()
    assert _report(_build(backends=("CUDA", "CPU")), toolchain=GPU_AND_NVCC).warnings == ()


def test_toolchain_backend_is_the_one_llama_build_sh_picks() -> None:
    assert NO_GPU.backend == "cpu"
    assert GPU_AND_NVCC.backend == "cuda"
    assert Toolchain("/usr/bin/nvidia-smi", ("GPU 0: X",), None).backend == "cpu"
    assert Toolchain(None, (), "/usr/local/cuda/bin/nvcc").backend == "cpu"


# -- the real command ---------------------------------------------------------------------


def _decode_lines(out: str) -> dict[str, str]:
    """``PASS  f16  ...`` lines, by precision."""
    lines = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("PASS", "FAIL"):
            lines[words[1]] = line
    return lines


@pytest.mark.slow
def test_doctor_passes_on_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--devices", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = _decode_lines(out)
    assert set(lines) == {"f16", "q8_0", "q4_k_m"}
    assert all(line.split()[0] == "PASS" for line in lines.values()), lines
    assert "backends        CPU" in out
    assert "every instruction set compiled in is present on this CPU" in out
    assert any(line.split()[:2] == ["cpu", "cpu"] for line in out.splitlines())
    assert out.rstrip().splitlines()[-1].startswith("doctor: OK")


@pytest.mark.slow
def test_doctor_reports_a_sigill_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--devices", "cpu", "--fault-precision", "q8_0"]) == 1
    lines = _decode_lines(capsys.readouterr().out)
    assert lines["q8_0"].split()[0] == "FAIL"
    assert SIGILL_WORDS in lines["q8_0"]
    assert lines["f16"].split()[0] == "PASS" and lines["q4_k_m"].split()[0] == "PASS"


@pytest.mark.slow
def test_doctor_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(DEMO_REPO / "tiny-llama", repo / "tiny-llama")
    code = main(["doctor", "--json", "--devices", "cpu", "--repo", str(repo)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"] is True
    assert doc["repo"] == str(repo)
    assert [c["precision"] for c in doc["checks"]] == ["f16", "q8_0", "q4_k_m"]
    assert all(c["ok"] and c["returncode"] == 0 for c in doc["checks"])
    assert all(c["path"].startswith(str(repo)) for c in doc["checks"])
    assert "CPU" in doc["build"]["backends"]
    assert doc["build"]["missing_features"] == []
    assert [d["id"] for d in doc["devices"]["data"]] == ["cpu"]


@pytest.mark.slow
def test_doctor_fails_with_nothing_to_decode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--devices", "cpu", "--repo", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no GGUF branch to decode" in out
    assert "doctor: FAIL: nothing to decode" in out

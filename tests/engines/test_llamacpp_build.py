"""The llama.cpp build probe: its parsers on literal text, then the installed build and the
demo GGUF files in real child processes."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from quantroute.config import DEMO_REPO
from quantroute.engines.exits import describe_exit
from quantroute.engines.llamacpp.build import (
    BuildInfo,
    BuildRecord,
    compiled_cpu_features,
    decode_check,
    machine_features,
    missing_features,
    parse_cpuinfo_flags,
    parse_system_info,
    probe_build,
    read_build_record,
)
from quantroute.errors import EngineCrashedError
from quantroute.registry.manifest import load_manifest
from quantroute.types import Precision

x86_only = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 feature names"
)

# What llama.cpp 0.3.36 prints for builds made three ways.
PORTABLE = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
)
NATIVE_SAPPHIRE_RAPIDS = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
    "BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
)
CUDA = (
    "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
    "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | SVE_CNT = 0 | LLAMAFILE = 1 |"
)
# /proc/cpuinfo of an AMD EPYC (Zen 3: AVX2, no AVX-512, no AMX), abridged.
ZEN3_CPUINFO = """\
processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD EPYC 7B13
flags		: fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni
"""
ARM_CPUINFO = """\
processor	: 0
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve i8mm
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PORTABLE, ("SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2")),
        (CUDA, ("SSE3", "AVX", "AVX2")),
        ("", ()),
        ("CUDA : ARCHS = 900 |", ()),
    ],
)
def test_compiled_cpu_features_are_the_cpu_section_set_to_one(
    text: str, expected: tuple[str, ...]
) -> None:
    features = compiled_cpu_features(text)
    assert tuple(f for f in features if f not in ("LLAMAFILE", "OPENMP", "REPACK")) == expected
    assert "SVE_CNT" not in features and "ARCHS" not in features


def test_system_info_sections_per_backend() -> None:
    sections = parse_system_info(CUDA)
    assert list(sections) == ["CUDA", "CPU"]
    assert sections["CUDA"]["ARCHS"] == "900"
    assert sections["CPU"]["SVE_CNT"] == "0"


@pytest.mark.parametrize(
    ("cpuinfo", "has", "lacks"),
    [
        (ZEN3_CPUINFO, {"SSE3", "AVX2", "FMA", "F16C", "BMI2"}, {"AVX512", "AMX_INT8"}),
        (ARM_CPUINFO, {"NEON", "ARM_FMA", "DOTPROD", "SVE", "MATMUL_INT8"}, {"SME", "AVX2"}),
    ],
)
def test_machine_features_from_cpuinfo(cpuinfo: str, has: set[str], lacks: set[str]) -> None:
    features = set(machine_features(parse_cpuinfo_flags(cpuinfo)))
    assert has <= features
    assert not lacks & features


@pytest.mark.parametrize(
    ("system_info", "cpuinfo", "missing"),
    [
        (PORTABLE, ZEN3_CPUINFO, ()),
        (
            NATIVE_SAPPHIRE_RAPIDS,
            ZEN3_CPUINFO,
            ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8"),
        ),
        (NATIVE_SAPPHIRE_RAPIDS, "", ()),  # flags unknown: nothing can be called missing
    ],
)
def test_missing_features_are_compiled_in_but_absent(
    system_info: str, cpuinfo: str, missing: tuple[str, ...]
) -> None:
    flags = parse_cpuinfo_flags(cpuinfo)
    assert missing_features(compiled_cpu_features(system_info), flags) == missing


def test_amx_build_on_a_cpu_without_amx() -> None:
    amx_cpu = ZEN3_CPUINFO.replace("sha_ni", "sha_ni avx512f avx512_vnni amx_int8")
    compiled = compiled_cpu_features("CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 |")
    assert missing_features(compiled, parse_cpuinfo_flags(amx_cpu)) == ()
    assert missing_features(compiled, parse_cpuinfo_flags(ZEN3_CPUINFO)) == ("AVX512", "AMX_INT8")


def test_build_record_read_from_the_prefix(tmp_path: Path) -> None:
    assert read_build_record(tmp_path) is None
    (tmp_path / "llama-build.json").write_text("{not json")
    assert read_build_record(tmp_path) is None
    wheel = "/cache/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    doc = {
        "key": "aa8feea27f9b6431",
        "backend": "cpu",
        "version": "0.3.36",
        "wheel": wheel,
        "cmake_flags": ["-DGGML_NATIVE=OFF", "-DGGML_AMX_INT8=OFF"],
    }
    (tmp_path / "llama-build.json").write_text(json.dumps(doc))
    record = read_build_record(tmp_path)
    assert record == BuildRecord(
        path=str(tmp_path / "llama-build.json"),
        key="aa8feea27f9b6431",
        backend="cpu",
        version="0.3.36",
        wheel=wheel,
        cmake_flags=("-DGGML_NATIVE=OFF", "-DGGML_AMX_INT8=OFF"),
    )


def test_build_info_json_round_trip() -> None:
    info = BuildInfo(
        llama_cpp_python="0.3.36",
        llama_version="0.5.0",
        ggml_version="0.25.3",
        ggml_commit=None,
        system_info=PORTABLE,
        backends=("CPU",),
        gpu_offload=False,
        cpu_features=compiled_cpu_features(PORTABLE),
        machine_features=("AVX2",),
        missing_features=(),
        record=BuildRecord("/v/llama-build.json", "k", "cpu", "0.3.36", "w.whl", ("-DX=1",)),
    )
    assert BuildInfo.from_json(json.loads(json.dumps(info.to_json()))) == info


# -- the installed build, in child processes --------------------------------------------


@x86_only
def test_probe_describes_the_portable_build() -> None:
    info = probe_build()
    assert info.llama_cpp_python == "0.3.36"
    assert info.backends[-1] == "CPU"
    if info.record is not None and info.record.backend == "cpu":
        assert info.backends == ("CPU",) and not info.gpu_offload
    # The library's own flags: the portable baseline, never AVX-512 or AMX.
    assert {"AVX", "AVX2", "FMA", "F16C", "BMI2"} <= set(info.cpu_features)
    assert not {f for f in info.cpu_features if f.startswith(("AVX512", "AMX"))}
    assert "AVX2" in info.machine_features
    assert info.missing_features == ()


def test_probe_reads_this_venvs_build_record() -> None:
    info = probe_build()
    if not (Path(sys.prefix) / "llama-build.json").is_file():
        pytest.skip("llama.cpp here was not installed by scripts/llama_build.sh")
    assert info.record is not None
    assert "-DGGML_NATIVE=OFF" in info.record.cmake_flags
    assert "-DGGML_AMX_INT8=OFF" in info.record.cmake_flags
    assert info.record.version == info.llama_cpp_python


def test_probe_never_loads_llama_cpp_in_the_caller() -> None:
    code = (
        "import sys\n"
        "from quantroute.engines.llamacpp.build import probe_build\n"
        "import quantroute.doctor\n"
        "assert probe_build().cpu_features\n"
        "print(sorted(m for m in sys.modules if m.startswith('llama_cpp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_child_that_dies_is_reported_in_words() -> None:
    with pytest.raises(EngineCrashedError) as caught:
        probe_build(fault="sigill")
    assert describe_exit(-signal.SIGILL) in caught.value.message


def _demo_files() -> dict[Precision, Path]:
    model_dir = DEMO_REPO / "tiny-llama"
    manifest = load_manifest(model_dir)
    return {  # the GGUF files (onnx_fp16 is precision f16 too, but a graph)
        s.precision: model_dir / s.file
        for s in manifest.branches.values()
        if s.engine == "llamacpp"
    }


@pytest.mark.parametrize("precision", [Precision.F16, Precision.Q8_0, Precision.Q4_K_M])
def test_decode_check_decodes_one_token(precision: Precision) -> None:
    check = decode_check(_demo_files()[precision])
    assert check.ok, check.detail
    assert check.returncode == 0
    assert check.detail.startswith("decoded token ") and "-token prompt" in check.detail
    assert 0 < check.seconds < 60


def test_decode_check_reports_sigill_in_words() -> None:
    check = decode_check(_demo_files()[Precision.Q8_0], fault="sigill")
    assert not check.ok
    assert check.returncode == -signal.SIGILL
    assert check.detail == describe_exit(-signal.SIGILL)
    assert "SIGILL" in check.detail and "troubleshooting.md#sigill" in check.detail


def test_decode_check_reports_a_file_llama_cpp_cannot_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    check = decode_check(bad)
    assert not check.ok and check.returncode > 0
    assert f"could not load {bad}" in check.detail


def test_decode_check_that_does_not_answer_in_time_is_killed() -> None:
    check = decode_check(_demo_files()[Precision.F16], timeout_s=0.01)
    assert not check.ok
    assert check.returncode == -signal.SIGKILL
    assert "no answer within 0.01 s" in check.detail


def test_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        decode_check(_demo_files()[Precision.F16], fault="segv")

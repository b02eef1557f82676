"""``quantroute doctor``: will this llama.cpp build serve this repository on this machine?

It reports, without running llama.cpp in its own process:

- the llama.cpp build (versions, backends, compiled-in CPU features, the build
  record of ``scripts/llama_build.sh``) and any instruction set it was compiled
  with that this CPU lacks, which kills it with SIGILL;
- whether a GPU and a CUDA toolkit are here, so which backend
  ``scripts/llama_build.sh`` would build, and whether the installed build is that one;
- the devices telemetry sees;
- a one-token decode of one branch of every precision in the repository, each in
  its own process (:func:`~quantroute.engines.llamacpp.build.decode_check`).

:attr:`DoctorReport.ok` is true when every precision decoded and no compiled
feature is missing; ``quantroute doctor`` exits 0 then, else 1.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantroute.engines.exits import TROUBLESHOOTING
from quantroute.engines.llamacpp.build import (
    CPUINFO_FLAGS,
    BuildInfo,
    DecodeCheck,
    decode_check,
    probe_build,
)
from quantroute.errors import DeviceError, EngineError
from quantroute.registry.manifest import BranchArtifact
from quantroute.registry.repository import scan_repository
from quantroute.telemetry.report import format_table, snapshot_to_json
from quantroute.telemetry.selection import provider_from_settings
from quantroute.telemetry.settings import TelemetrySettings
from quantroute.telemetry.snapshot import DeviceSnapshot
from quantroute.types import Precision

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llama_build.sh"
NVCC_FALLBACK = Path("/usr/local/cuda/bin/nvcc")  # where llama_build.sh also looks
REBUILD = "rm -rf .venv; make serve"
TOOL_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Toolchain:
    """What ``scripts/llama_build.sh`` looks at to pick a backend (with
    ``QUANTROUTE_LLAMA_BACKEND=auto``): a GPU that ``nvidia-smi -L`` lists and ``nvcc``."""

    smi: str | None  # nvidia-smi's path
    gpus: tuple[str, ...]  # its -L lines, "GPU 0: NVIDIA H100 ..."
    nvcc: str | None

    @property
    def backend(self) -> str:
        return "cuda" if self.gpus and self.nvcc else "cpu"


@dataclass(frozen=True, slots=True)
class ScriptBuild:
    """The build ``scripts/llama_build.sh`` would make now (its ``--flags`` and ``--key``)."""

    script: str
    backend: str
    key: str


@dataclass(frozen=True, slots=True)
class PrecisionCheck:
    precision: Precision
    model: str
    branch: str
    check: DecodeCheck


@dataclass(frozen=True, slots=True)
class DoctorReport:
    build: BuildInfo | None
    build_error: str | None  # why the build probe failed (its crash in words)
    toolchain: Toolchain
    script: ScriptBuild | None  # None where scripts/llama_build.sh is not beside the package
    devices: DeviceSnapshot | None
    devices_error: str | None
    repo: Path
    repo_problems: tuple[str, ...]
    checks: tuple[PrecisionCheck, ...]

    @property
    def ok(self) -> bool:
        """Every precision decoded, and the build has no instruction this CPU lacks."""
        return (
            self.build is not None
            and not self.build.missing_features
            and bool(self.checks)
            and all(c.check.ok for c in self.checks)
        )

    @property
    def warnings(self) -> tuple[str, ...]:
        """What is worth fixing but does not fail the check."""
        out: list[str] = []
        build, tools, script = self.build, self.toolchain, self.script
        if build is not None:
            has_cuda = "CUDA" in build.backends
            if tools.backend == "cuda" and not has_cuda:
                out.append(
                    "a GPU and a CUDA toolkit are here, but this build has no CUDA backend: "
                    f"it runs on the CPU only; rebuild with `{REBUILD}`"
                )
            if has_cuda and not tools.gpus:
                out.append("this build has CUDA, but no GPU is visible: it runs on the CPU")
            if build.record is None:
                out.append(
                    "no build record (llama-build.json) in this environment: llama.cpp was "
                    "not installed by scripts/llama_build.sh, so its flags are unknown"
                )
            elif script is not None and script.key != build.record.key:
                out.append(
                    f"the installed build (key {build.record.key}, {build.record.backend}) is not "
                    f"the one scripts/llama_build.sh would make now (key {script.key}, "
                    f"{script.backend}): run `make` to rebuild"
                )
        if tools.gpus and not tools.nvcc:
            out.append(
                "a GPU but no CUDA toolkit (nvcc): scripts/llama_build.sh builds for the CPU"
            )
        out += [f"model left out: {p}" for p in self.repo_problems]
        if not self.checks:
            out.append(f"no GGUF branch to decode in {self.repo}")
        return tuple(out)


# -- gathering ----------------------------------------------------------------------------


def _run_tool(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def find_toolchain(smi_binary: str = "nvidia-smi") -> Toolchain:
    """A GPU (``nvidia-smi -L``) and ``nvcc`` (on PATH or in /usr/local/cuda), as
    ``scripts/llama_build.sh`` looks for them."""
    smi = shutil.which(smi_binary)
    listing = _run_tool([smi, "-L"]) if smi else None
    gpus = tuple(line.strip() for line in (listing or "").splitlines() if line.startswith("GPU "))
    nvcc = shutil.which("nvcc")
    if nvcc is None and NVCC_FALLBACK.is_file():
        nvcc = str(NVCC_FALLBACK)
    return Toolchain(smi, gpus, nvcc)


def script_build(script: Path = BUILD_SCRIPT) -> ScriptBuild | None:
    """Ask ``scripts/llama_build.sh`` which build it would make; ``None`` without it."""
    if not script.is_file():
        return None
    command = ["bash", str(script)]
    flags = _run_tool([*command, "--flags"])
    venv = Path(sys.prefix)  # the key names a python: this environment's, as `make` does
    key = _run_tool([*command, "--key", *([str(venv)] if (venv / "bin/python").exists() else [])])
    if flags is None or key is None or not flags.startswith("backend="):
        return None
    backend = flags.splitlines()[0].removeprefix("backend=")
    return ScriptBuild(str(script), backend, key.strip())


def read_devices(telemetry: TelemetrySettings) -> tuple[DeviceSnapshot | None, str | None]:
    """One reading of every device, as ``quantroute devices`` makes it."""
    provider = provider_from_settings(telemetry)
    try:
        devices = provider.read()
        topology = provider.topology()
    except DeviceError as exc:
        return None, exc.message
    finally:
        provider.close()
    snapshot = DeviceSnapshot(
        taken_at=time.monotonic(),
        devices=tuple(devices),
        topology=topology,
        provider=provider.name,
    )
    return snapshot, None


def check_precisions(
    repo: Path,
    *,
    faults: Mapping[Precision, str] | None = None,
    n_threads: int = 1,
) -> tuple[tuple[PrecisionCheck, ...], tuple[str, ...]]:
    """Decode one token with one branch of every GGUF precision in ``repo`` (the
    reference branch where it has that precision), each in its own process.

    ``faults`` maps a precision to a :data:`~quantroute.engines.llamacpp.build.FAULTS`
    name its child is to suffer (tests). Returns the checks and the repository's problems.
    """
    scan = scan_repository(repo)
    chosen: dict[Precision, tuple[str, BranchArtifact]] = {}
    for entry in scan.models:
        for artifact in entry.artifacts:  # reference first
            if artifact.engine == "llamacpp" and artifact.precision.spec.gguf:
                chosen.setdefault(artifact.precision, (entry.manifest.model, artifact))
    faults = faults or {}
    checks = []
    for precision in sorted(chosen, key=lambda p: (p.spec.rank, p.value)):
        model, artifact = chosen[precision]
        check = decode_check(artifact.path, n_threads=n_threads, fault=faults.get(precision))
        checks.append(PrecisionCheck(precision, model, artifact.name, check))
    return tuple(checks), scan.problems


def run_doctor(
    repo: Path,
    telemetry: TelemetrySettings,
    *,
    faults: Mapping[Precision, str] | None = None,
    n_threads: int = 1,
) -> DoctorReport:
    """Gather everything ``quantroute doctor`` reports."""
    build: BuildInfo | None = None
    build_error = None
    try:
        build = probe_build()
    except EngineError as exc:
        build_error = exc.message
    checks, problems = check_precisions(repo, faults=faults, n_threads=n_threads)
    toolchain, script = find_toolchain(telemetry.nvidia_smi_path), script_build()
    devices, devices_error = read_devices(telemetry)  # last: the report shows it fresh
    return DoctorReport(
        build=build,
        build_error=build_error,
        toolchain=toolchain,
        script=script,
        devices=devices,
        devices_error=devices_error,
        repo=repo,
        repo_problems=problems,
        checks=checks,
    )


# -- rendering ------------------------------------------------------------------------------


def _build_lines(build: BuildInfo) -> list[str]:
    instructions = [f for f in build.cpu_features if f in CPUINFO_FLAGS]
    others = [f for f in build.cpu_features if f not in CPUINFO_FLAGS]
    lines = [
        f"  llama-cpp-python {build.llama_cpp_python}, llama.cpp {build.llama_version or '?'}, "
        f"ggml {build.ggml_version or '?'} (commit {build.ggml_commit or '?'})",
        f"  backends        {', '.join(build.backends) or '?'} "
        f"(GPU offload: {'yes' if build.gpu_offload else 'no'})",
        f"  compiled for    {' '.join(instructions) or '-'}"
        + (f"  (also {' '.join(others)})" if others else ""),
        f"  this CPU has    {' '.join(build.machine_features) or 'unknown (no /proc/cpuinfo)'}",
    ]
    record = build.record
    if record is None:
        lines.append("  build record    none (not installed by scripts/llama_build.sh)")
    else:
        lines.append(f"  build record    {record.path}: {record.backend}, key {record.key}")
        lines.append(f"  cmake flags     {' '.join(record.cmake_flags)}")
    if build.missing_features:
        lines.append(
            f"  !! this build will die with SIGILL here: it was compiled with "
            f"{', '.join(build.missing_features)}, which this CPU lacks. Rebuild with `make` "
            f"({REBUILD}); see {TROUBLESHOOTING}#sigill"
        )
    else:
        lines.append("  every instruction set compiled in is present on this CPU")
    return lines


def _no_gpu(tools: Toolchain) -> str:
    return "none (no nvidia-smi)" if tools.smi is None else f"none ({tools.smi} -L lists none)"


def format_report(report: DoctorReport) -> str:
    """The report for people, one section per question."""
    lines = ["llama.cpp build"]
    if report.build is None:
        lines.append(f"  !! could not probe the build: {report.build_error}")
    else:
        lines += _build_lines(report.build)
    tools, script = report.toolchain, report.script
    lines += [
        "GPU and CUDA toolkit",
        f"  GPU             {'; '.join(tools.gpus) or _no_gpu(tools)}",
        f"  CUDA toolkit    {tools.nvcc or 'none (no nvcc)'}",
    ]
    if script is None:
        lines.append(f"  llama_build.sh  would build {tools.backend} (script not found)")
    else:
        record = report.build.record if report.build else None
        same = record is not None and record.key == script.key
        lines.append(
            f"  llama_build.sh  would build {script.backend}, key {script.key}"
            + (" (the installed build)" if same else " (not the installed build)")
        )
    lines.append("devices")
    if report.devices is None:
        lines.append(f"  !! could not read the devices: {report.devices_error}")
    else:
        lines += ["  " + line for line in format_table(report.devices).splitlines()]
    lines.append(f"decode checks: one token per precision, each in its own process ({report.repo})")
    for c in report.checks:
        lines.append(
            f"  {'PASS' if c.check.ok else 'FAIL'}  {c.precision.value:<7} "
            f"{c.model}/{c.branch:<10} {c.check.seconds:5.2f} s  {c.check.detail}"
        )
    warnings = report.warnings
    if warnings:
        lines.append("warnings")
        lines += [f"  ! {w}" for w in warnings]
    failed = [c for c in report.checks if not c.check.ok]
    if report.ok:
        verdict = f"OK: {len(report.checks)} precision(s) decode, and the build fits this CPU"
    else:
        reasons = []
        if report.build is None:
            reasons.append("the build probe failed")
        elif report.build.missing_features:
            reasons.append("the build uses instructions this CPU lacks")
        if failed:
            reasons.append(f"{len(failed)} of {len(report.checks)} precision(s) failed")
        if not report.checks:
            reasons.append("nothing to decode")
        verdict = f"FAIL: {'; '.join(reasons)}"
    lines.append(f"doctor: {verdict}")
    return "\n".join(lines)


def report_to_json(report: DoctorReport) -> dict[str, Any]:
    """The report for programs (``quantroute doctor --json``)."""
    return {
        "ok": report.ok,
        "build": None if report.build is None else report.build.to_json(),
        "build_error": report.build_error,
        "toolchain": {
            "nvidia_smi": report.toolchain.smi,
            "gpus": list(report.toolchain.gpus),
            "nvcc": report.toolchain.nvcc,
            "backend": report.toolchain.backend,
        },
        "llama_build_sh": None
        if report.script is None
        else {
            "script": report.script.script,
            "backend": report.script.backend,
            "key": report.script.key,
        },
        "devices": None if report.devices is None else snapshot_to_json(report.devices),
        "devices_error": report.devices_error,
        "repo": str(report.repo),
        "repo_problems": list(report.repo_problems),
        "checks": [
            {
                "precision": c.precision.value,
                "model": c.model,
                "branch": c.branch,
                "path": c.check.path,
                "ok": c.check.ok,
                "returncode": c.check.returncode,
                "detail": c.check.detail,
                "seconds": round(c.check.seconds, 3),
            }
            for c in report.checks
        ],
        "warnings": list(report.warnings),
    }

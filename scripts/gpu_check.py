"""Check quantroute's GPU telemetry against the real thing (run by scripts/gpu_check.sh and
scripts/gpu_all.sh).

1. Reads every GPU through NVML and through nvidia-smi (quantroute's own
   providers) and compares them: total memory within 1 %, used memory within
   1 % of total.
2. Allocates 1 GiB with PyTorch (``torch.empty(1 << 28, dtype=torch.float32,
   device="cuda")``) and checks that NVML's free memory moved by 1 GiB ± 10 %,
   after the CUDA context was created (its size is reported separately).
3. Reports each GPU's driver, the CUDA version the driver supports, and its peak memory
   bandwidth: ``2 x max memory clock x bus width / 8`` (HBM and GDDR move data on both
   clock edges; NVML's ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)`` and
   ``nvmlDeviceGetMemoryBusWidth``), beside the datasheet figure where the name is known
   (H200: 4800 GB/s).

Prints a report; ``--json PATH`` also writes it, every figure included. Exit status: 0 all
checks passed, 1 a mismatch, 2 a check could not run (no GPU, no driver, no nvidia-smi, no
CUDA PyTorch).

``--summarize WORKDIR`` instead gathers what ``scripts/gpu_all.sh`` recorded (its steps,
this check's JSON, the gpu tests' and the benchmark's output) into ``summary.json`` and
``summary.txt`` in ``--out`` (``$QR_GPU_OUT``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the summary needs none of it
    from quantroute.telemetry import DeviceStats, NvmlProvider


MiB = 1 << 20
GiB = 1 << 30
EXIT_OK, EXIT_MISMATCH, EXIT_CANNOT_RUN = 0, 1, 2
# peak memory bandwidth (GB/s) by name, first match wins: the datasheets' figures
DATASHEET_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
)


@dataclass(frozen=True, slots=True)
class Finding:
    ok: bool
    line: str
    figures: dict[str, Any] = field(default_factory=dict)


def compare_readings(
    nvml: Sequence[DeviceStats], smi: Sequence[DeviceStats], tolerance: float = 0.01
) -> list[Finding]:
    """Match GPUs by UUID (else by index) and compare total and used memory."""
    findings = []
    by_uuid = {d.uuid: d for d in smi if d.uuid}
    if len(nvml) != len(smi):
        findings.append(
            Finding(False, f"GPU count differs: NVML {len(nvml)}, nvidia-smi {len(smi)}")
        )
    for i, a in enumerate(nvml):
        b = by_uuid.get(a.uuid) if a.uuid else None
        if b is None and i < len(smi):
            b = smi[i]
        if b is None:
            findings.append(Finding(False, f"{a.id} ({a.uuid}): not listed by nvidia-smi"))
            continue
        total_diff = abs(a.total_bytes - b.total_bytes) / max(a.total_bytes, 1)
        used_diff = abs(a.used_bytes - b.used_bytes) / max(a.total_bytes, 1)
        findings.append(
            Finding(
                total_diff <= tolerance,
                f"{a.id} {a.name}: total NVML {a.total_bytes // MiB} MiB, nvidia-smi "
                f"{b.total_bytes // MiB} MiB ({total_diff:.2%})",
                {
                    "device": a.id,
                    "check": "total",
                    "nvml_bytes": a.total_bytes,
                    "smi_bytes": b.total_bytes,
                    "diff_of_total": total_diff,
                },
            )
        )
        findings.append(
            Finding(
                used_diff <= tolerance,
                f"{a.id}: used NVML {a.used_bytes // MiB} MiB, nvidia-smi "
                f"{b.used_bytes // MiB} MiB ({used_diff:.2%} of total)",
                {
                    "device": a.id,
                    "check": "used",
                    "nvml_bytes": a.used_bytes,
                    "smi_bytes": b.used_bytes,
                    "diff_of_total": used_diff,
                },
            )
        )
    return findings


def check_allocation(nvml: NvmlProvider, tolerance: float = 0.10) -> list[Finding]:
    """Allocate 1 GiB on the first visible CUDA device and watch NVML's free memory move."""
    try:
        import torch
    except ImportError:
        return [Finding(False, "allocation check cannot run: PyTorch is not installed")]
    if not torch.cuda.is_available():
        return [Finding(False, "allocation check cannot run: PyTorch has no CUDA device")]
    props = torch.cuda.get_device_properties(0)
    uuid = getattr(props, "uuid", None)
    devices = nvml.read()
    target = next((d for d in devices if uuid is not None and d.uuid == f"GPU-{uuid}"), None)
    if target is None:
        target = devices[0]
    index = devices.index(target)

    def free() -> int:
        return nvml.read()[index].free_bytes

    before_context = free()
    torch.zeros(1, device="cuda")  # creates the CUDA context
    torch.cuda.synchronize()
    before = free()
    tensor = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    torch.cuda.synchronize()
    after = free()
    moved = before - after
    ok = abs(moved - GiB) <= tolerance * GiB
    context = before_context - before
    findings = [
        Finding(
            True,
            f"{target.id}: CUDA context took {context / MiB:.0f} MiB",
            {"device": target.id, "check": "context", "bytes": context},
        ),
        Finding(
            ok,
            f"{target.id}: 1 GiB tensor moved free memory by {moved / MiB:.0f} MiB "
            f"(expected {GiB // MiB} ± {tolerance * GiB / MiB:.0f} MiB)",
            {
                "device": target.id,
                "check": "allocation",
                "allocated_bytes": GiB,
                "moved_bytes": moved,
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
            },
        ),
    ]
    del tensor
    torch.cuda.empty_cache()
    return findings


def datasheet_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in DATASHEET_GBPS if key in name), None)


def gpu_info(nvml: Any = None) -> list[dict[str, Any]]:
    """Per GPU: name, driver, the CUDA version the driver supports, memory, compute
    capability and peak memory bandwidth (``2 x max memory clock x bus width / 8``; None
    where NVML does not say)."""
    if nvml is None:
        import pynvml

        nvml = pynvml

    def ask(fn: str, *args: Any) -> Any:
        try:
            return getattr(nvml, fn)(*args)
        except (nvml.NVMLError, AttributeError):
            return None

    def text(value: Any) -> Any:
        return value.decode() if isinstance(value, bytes) else value

    nvml.nvmlInit()
    try:
        driver = text(ask("nvmlSystemGetDriverVersion"))
        cuda = ask("nvmlSystemGetCudaDriverVersion_v2") or ask("nvmlSystemGetCudaDriverVersion")
        cuda_version = None if not cuda else f"{cuda // 1000}.{cuda % 1000 // 10}"
        out = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = str(text(nvml.nvmlDeviceGetName(h)))
            memory = ask("nvmlDeviceGetMemoryInfo", h)
            bus_bits = ask("nvmlDeviceGetMemoryBusWidth", h)
            mem_mhz = ask("nvmlDeviceGetMaxClockInfo", h, getattr(nvml, "NVML_CLOCK_MEM", 2))
            cc = ask("nvmlDeviceGetCudaComputeCapability", h)
            nvml_gbps = 2 * mem_mhz * 1e6 * bus_bits / 8 / 1e9 if bus_bits and mem_mhz else None
            out.append({
                "index": i, "id": f"cuda:{i}", "name": name,
                "uuid": text(ask("nvmlDeviceGetUUID", h)),
                "driver_version": driver, "cuda_driver_version": cuda_version,
                "memory_total_bytes": None if memory is None else int(memory.total),
                "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
                "memory_bus_width_bits": bus_bits, "max_memory_clock_mhz": mem_mhz,
                "bandwidth_gbps_nvml": nvml_gbps, "bandwidth_gbps_datasheet": datasheet_gbps(name),
            })  # fmt: skip
        return out
    finally:
        nvml.nvmlShutdown()


def info_lines(info: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for g in info:
        bw = g["bandwidth_gbps_nvml"]
        out.append(
            f"{g['id']} {g['name']}: driver {g['driver_version']}, CUDA (driver) "
            f"{g['cuda_driver_version']}, compute capability {g['compute_capability']}, "
            f"{(g['memory_total_bytes'] or 0) / GiB:.1f} GiB; memory bus "
            f"{g['memory_bus_width_bits']} bits at {g['max_memory_clock_mhz']} MHz max = "
            f"{'?' if bw is None else f'{bw:.0f}'} GB/s peak (2 x clock x width / 8); "
            f"datasheet {g['bandwidth_gbps_datasheet'] or '?'} GB/s"
        )
    return out


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def run_checks(args: argparse.Namespace) -> int:
    from quantroute.telemetry import DeviceError, NvmlProvider, SmiProvider

    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    print(f"quantroute GPU check, {now}")
    report: dict[str, Any] = {"date": now, "gpus": [], "findings": []}

    def finish(code: int, result: str) -> int:
        report.update(exit=code, result=result)
        write_json(args.json, report)
        return code

    try:
        nvml = NvmlProvider()
    except DeviceError as exc:
        smi = shutil.which(args.nvidia_smi)
        print(f"FAIL: no NVIDIA GPU usable here: {exc.message}")
        print(f"      nvidia-smi: {smi or 'not found on PATH'}")
        report["reason"] = f"no NVIDIA GPU usable here: {exc.message}"
        return finish(EXIT_CANNOT_RUN, "cannot run")
    try:
        try:
            report["gpus"] = gpu_info()
            for line in info_lines(report["gpus"]):
                print(line)
        except Exception as exc:  # the figures are a report: never fail the checks on them
            print(f"(GPU info incomplete: {type(exc).__name__}: {exc})")
        nvml_devices = nvml.read()
        print(f"NVML: {len(nvml_devices)} GPU(s)")
        if shutil.which(args.nvidia_smi) is None:
            print(f"FAIL: {args.nvidia_smi} not found on PATH; cannot cross-check NVML")
            report["reason"] = f"{args.nvidia_smi} not found on PATH"
            return finish(EXIT_CANNOT_RUN, "cannot run")
        try:
            smi_devices = SmiProvider(binary=args.nvidia_smi, detail_every=0).read()
        except DeviceError as exc:
            print(f"FAIL: {exc.message}")
            report["reason"] = exc.message
            return finish(EXIT_CANNOT_RUN, "cannot run")
        print(f"nvidia-smi: {len(smi_devices)} GPU(s)")
        findings = compare_readings(nvml_devices, smi_devices)
        if not args.skip_alloc:
            findings += check_allocation(nvml)
    finally:
        nvml.close()
    for finding in findings:
        print(f"{'ok  ' if finding.ok else 'FAIL'}  {finding.line}")
    report["findings"] = [{"ok": f.ok, "line": f.line, **f.figures} for f in findings]
    failed = [f for f in findings if not f.ok]
    print(f"RESULT: {'OK' if not failed else f'{len(failed)} check(s) failed'}")
    if any("cannot run" in f.line for f in failed):
        return finish(EXIT_CANNOT_RUN, "cannot run")
    return finish(EXIT_MISMATCH if failed else EXIT_OK, "mismatch" if failed else "ok")


# -- the summary of scripts/gpu_all.sh ------------------------------------------------

BOUND_FORMULA = (
    "decode tok/s bound at B concurrent sequences = B x bandwidth / bytes read per step, "
    "bytes per step = the GGUF's weight bytes less the token-embedding table (a step reads "
    "one row of it per sequence); KV-cache reads (< 6 % here) and compute left out: the "
    "model is bandwidth-bound"
)
ROUND_LINE = re.compile(r"round (\d+)\s+(\S+)\s+(\d+) client\(s\)\s+([\d.]+) tok/s\s+(\d+) streams")
MEASURED = re.compile(r"^(\S+): measured (\d+) B, estimated (\d+) B")
NOT_MEASURED = re.compile(r"^(\S+): not measured")
PRESSURE = re.compile(r"^under pressure: (\S+) \((.*)\) after ([\d.]+) s")
BEFORE = re.compile(r"^before pressure: (\S+)")
PYTEST_TAIL = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def weight_bytes_per_step(path: Path) -> dict[str, int] | None:
    """Bytes a decode step reads of a GGUF's weights: every tensor but the token-embedding
    table (of which it reads one row per sequence), and the file's size beside it."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
    except Exception:
        return None
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    embd = tensors.get("token_embd.weight", 0)
    return {
        "file_bytes": path.stat().st_size,
        "tensor_bytes": sum(tensors.values()),
        "token_embd_bytes": embd,
        "bytes_per_step": sum(tensors.values()) - embd,
    }


def _bench(work: Path, out: Path, bandwidth: float | None) -> dict[str, Any]:
    """Per system and client count: decode tok/s (the benchmark's JSON, else its per-round
    log lines when it was cut short) and its fraction of the bandwidth bound."""
    model = _load_json(work / "bench_model.json") or {}
    weights = _load_json(work / "weights.json")  # once the model is written (gguf is slow)
    if weights is None and model.get("path") and (work / "synth.rc").is_file():
        weights = weight_bytes_per_step(Path(model["path"]))
        if weights is not None:
            (work / "weights.json").write_text(json.dumps(weights) + "\n")
    data = _load_json(out / "bench_serving.json")
    cells: list[dict[str, Any]] = []
    parallel = None
    source = "none"
    if isinstance(data, dict) and data.get("cells"):
        source = "bench_serving.json"
        parallel = int(data.get("settings", {}).get("parallel") or 0) or None
        for c in data["cells"]:
            cells.append({k: c.get(k) for k in (
                "system", "clients", "rounds", "streams", "aggregate_tok_s", "median_ttft_ms",
                "p99_itl_ms", "cpu_us_per_token", "gateway_cpu_us_per_token", "text_mismatches",
                "errors", "round_tok_s_min", "round_tok_s_max")})  # fmt: skip
    else:
        rates: dict[tuple[str, int], list[float]] = {}
        for m in ROUND_LINE.finditer(_read(work / "logs" / "bench.log")):
            rates.setdefault((m[2], int(m[3])), []).append(float(m[4]))
        if rates:
            source = "bench.log (per-round lines; the run was cut short)"
        for (system, n), values in sorted(rates.items()):
            cells.append({"system": system, "clients": n, "rounds": len(values),
                          "aggregate_tok_s": statistics.fmean(values)})  # fmt: skip
    per_step = None if weights is None else weights["bytes_per_step"]
    for c in cells:
        b = min(c["clients"], parallel or c["clients"])
        if c.get("aggregate_tok_s") is not None:
            c["per_sequence_tok_s"] = c["aggregate_tok_s"] / b
        if bandwidth and per_step and c.get("aggregate_tok_s") is not None:
            c["bound_tok_s"] = b * bandwidth * 1e9 / per_step
            c["fraction_of_bound"] = c["aggregate_tok_s"] / c["bound_tok_s"]
    return {
        "source": source,
        "model": model,
        "weights": weights,
        "bandwidth_gbps": bandwidth,
        "formula": BOUND_FORMULA,
        "cells": cells,
        "failures": (data or {}).get("failures") if isinstance(data, dict) else None,
        "llama_server": (data or {}).get("llama_server") if isinstance(data, dict) else None,
    }


def _gpu_tests(log: str) -> dict[str, Any]:
    out: dict[str, Any] = {"footprints": [], "placements": None}
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("placements:"):
            out["placements"] = line.partition(":")[2].strip()
        elif m := MEASURED.match(line):
            measured, estimated = int(m[2]), int(m[3])
            out["footprints"].append({"branch": m[1], "measured_bytes": measured,
                                      "estimated_bytes": estimated,
                                      "measured_over_estimated": measured / estimated})  # fmt: skip
        elif m := NOT_MEASURED.match(line):
            out["footprints"].append({"branch": m[1], "measured_bytes": None})
        elif m := BEFORE.match(line):
            out["before_pressure"] = m[1]
        elif m := PRESSURE.match(line):
            out["under_pressure"] = {"branch": m[1], "reason": m[2], "after_s": float(m[3])}
        elif m := PYTEST_TAIL.match(line):
            out["pytest"] = m[1]
    return out


def summarize(work: Path, out: Path) -> dict[str, Any]:
    """Gather gpu_all.sh's record into out/summary.json and out/summary.txt."""
    steps = [json.loads(x) for x in _read(work / "steps.jsonl").splitlines() if x.strip()]
    info = dict(line.split("=", 1) for line in _read(work / "info.env").splitlines() if "=" in line)
    check = _load_json(out / "gpu_check.json") or {}
    gpus = check.get("gpus") or []
    override = float(info["hbm_gbps_override"]) if info.get("hbm_gbps_override") else None
    bandwidth, bandwidth_source = override, "QR_HBM_GBPS" if override else None
    if bandwidth is None and gpus:
        g = gpus[0]
        if g.get("bandwidth_gbps_nvml"):
            bandwidth, bandwidth_source = g["bandwidth_gbps_nvml"], "NVML: 2 x clock x width / 8"
        elif g.get("bandwidth_gbps_datasheet"):
            bandwidth, bandwidth_source = g["bandwidth_gbps_datasheet"], "datasheet"
    if bandwidth is None and (sheet := datasheet_gbps(info.get("smi_gpu", ""))):
        bandwidth, bandwidth_source = sheet, "datasheet (by nvidia-smi's name)"
    bench = _bench(work, out, bandwidth)
    if gpus and gpus[0].get("bandwidth_gbps_datasheet") and bench["weights"]:
        sheet = gpus[0]["bandwidth_gbps_datasheet"]
        for c in bench["cells"]:
            if c.get("bound_tok_s"):
                c["fraction_of_datasheet_bound"] = c["fraction_of_bound"] * bandwidth / sheet
    summary = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": info.get("mode"),
        "info": info,
        "gpus": gpus,
        "bandwidth_gbps": bandwidth,
        "bandwidth_source": bandwidth_source,
        "steps": steps,
        "gpu_check": {k: check.get(k) for k in ("result", "reason", "findings")},
        "gpu_tests": _gpu_tests(_read(work / "logs" / "gpu_tests.log")),
        "bench": bench,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.txt").write_text("\n".join(summary_lines(summary)) + "\n")
    return summary


def _num(cell: dict[str, Any], key: str, fmt: str) -> str:
    v = cell.get(key)
    return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0] or 0))


def summary_lines(s: dict[str, Any]) -> list[str]:
    info = s["info"]
    lines = [
        f"quantroute GPU run ({s['mode']} mode), summary written {s['date']}",
        f"host {info.get('host', '?')}; {info.get('cpus', '?')} CPUs; "
        f"python {info.get('python', '?')}",
        f"nvidia-smi: {info.get('smi_gpu', 'none')}; driver {info.get('smi_driver', '-')}; "
        f"CUDA (driver) {info.get('smi_cuda', '-')}",
        f"nvcc: {info.get('nvcc', '-')}; torch {info.get('torch', '-')}",
        f"llama.cpp: {info.get('llama_cpp', '-')}; llama-server: {info.get('llama_server', '-')}",
        f"the kit's setup and build: {info.get('setup_and_build_s', '?')} s before gpu_all.sh"
        + (f"; {info['cmake_cuda']}" if info.get("cmake_cuda") else ""),
    ]
    lines += info_lines(s["gpus"])
    lines.append("")
    lines.append("steps:")
    for st in s["steps"]:
        lines.append(
            f"  {st['name']:<12} {st['status']:<8} rc={st['rc']:<4} {st['seconds']:>4} s "
            f"(budget {st['budget_s']} s){' - ' + st['note'] if st.get('note') else ''}"
        )
    check = s["gpu_check"]
    lines += ["", f"gpu_check: {check.get('result') or 'not run'}"
              + (f" ({check['reason']})" if check.get("reason") else "")]  # fmt: skip
    for f in check.get("findings") or []:
        lines.append(f"  {'ok  ' if f['ok'] else 'FAIL'} {f['line']}")
    t = s["gpu_tests"]
    lines += ["", f"gpu tests: {t.get('pytest', 'no result line')}"]
    if t.get("placements"):
        lines.append(f"  placements: {t['placements']}")
    for fp in t["footprints"]:
        if fp["measured_bytes"] is None:
            lines.append(f"  {fp['branch']}: not measured (NVML listed no memory for its pid)")
        else:
            lines.append(
                f"  {fp['branch']}: NVML {fp['measured_bytes'] / MiB:.0f} MiB, memory model "
                f"{fp['estimated_bytes'] / MiB:.0f} MiB ({fp['measured_over_estimated'] - 1:+.0%})"
            )
    if t.get("before_pressure"):
        lines.append(f"  default request before pressure: {t['before_pressure']}")
    if t.get("under_pressure"):
        p = t["under_pressure"]
        lines.append(f"  under pressure: {p['branch']} after {p['after_s']:.2f} s ({p['reason']})")
    b = s["bench"]
    lines += ["", f"serving benchmark ({b['source']}):"]
    if b["model"]:
        lines.append(f"  model {b['model'].get('path')}: {b['model'].get('description', '')}")
    if b["weights"]:
        w = b["weights"]
        lines.append(
            f"  {w['file_bytes'] / 1e9:.3f} GB file, {w['bytes_per_step'] / 1e9:.3f} GB read "
            f"per decode step (less the {w['token_embd_bytes'] / 1e6:.0f} MB token embedding)"
        )
    if s["bandwidth_gbps"]:
        lines.append(f"  bandwidth {s['bandwidth_gbps']:.0f} GB/s ({s['bandwidth_source']})")
    lines.append(f"  bound: {b['formula']}")
    header = f"  {'system':<14} {'clients':>7} {'tok/s':>9} {'bound':>9} {'fraction':>8}"
    lines.append(header + f" {'per seq':>8} {'TTFT ms':>8} {'p99 ITL ms':>10}")
    for c in sorted(b["cells"], key=lambda c: (c["clients"], c["system"])):
        lines.append(
            f"  {c['system']:<14} {c['clients']:>7} {_num(c, 'aggregate_tok_s', '9.1f')} "
            f"{_num(c, 'bound_tok_s', '9.0f')} {_num(c, 'fraction_of_bound', '8.1%')} "
            f"{_num(c, 'per_sequence_tok_s', '8.1f')} {_num(c, 'median_ttft_ms', '8.1f')} "
            f"{_num(c, 'p99_itl_ms', '10.2f')}"
        )
    for f in b.get("failures") or []:
        lines.append(f"  FAILED: {f}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi executable")
    parser.add_argument("--skip-alloc", action="store_true", help="skip the PyTorch allocation")
    parser.add_argument("--json", type=Path, help="also write the report, every figure, here")
    parser.add_argument(
        "--summarize", type=Path, metavar="WORKDIR", help="summarize gpu_all.sh's record"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("QR_GPU_OUT", "/tmp/qr-gpu-out"))
    )
    args = parser.parse_args(argv)
    if args.summarize is not None:
        summary = summarize(args.summarize, args.out)
        print("\n".join(summary_lines(summary)))
        return EXIT_OK
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())

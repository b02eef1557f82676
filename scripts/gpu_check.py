"""Check quantroute's GPU telemetry against the real thing (run by scripts/gpu_check.sh).

1. Reads every GPU through NVML and through nvidia-smi (quantroute's own
   providers) and compares them: total memory within 1 %, used memory within
   1 % of total.
2. Allocates 1 GiB with PyTorch (``torch.empty(1 << 28, dtype=torch.float32,
   device="cuda")``) and checks that NVML's free memory moved by 1 GiB ± 10 %,
   after the CUDA context was created (its size is reported separately).

Prints a report. Exit status: 0 all checks passed, 1 a mismatch, 2 a check
could not run (no GPU, no driver, no nvidia-smi, no CUDA PyTorch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from quantroute.telemetry import DeviceError, DeviceStats, NvmlProvider, SmiProvider

MiB = 1 << 20
GiB = 1 << 30
EXIT_OK, EXIT_MISMATCH, EXIT_CANNOT_RUN = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Finding:
    ok: bool
    line: str


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
            )
        )
        findings.append(
            Finding(
                used_diff <= tolerance,
                f"{a.id}: used NVML {a.used_bytes // MiB} MiB, nvidia-smi "
                f"{b.used_bytes // MiB} MiB ({used_diff:.2%} of total)",
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
    findings = [
        Finding(True, f"{target.id}: CUDA context took {(before_context - before) / MiB:.0f} MiB"),
        Finding(
            ok,
            f"{target.id}: 1 GiB tensor moved free memory by {moved / MiB:.0f} MiB "
            f"(expected {GiB // MiB} ± {tolerance * GiB / MiB:.0f} MiB)",
        ),
    ]
    del tensor
    torch.cuda.empty_cache()
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi executable")
    parser.add_argument("--skip-alloc", action="store_true", help="skip the PyTorch allocation")
    args = parser.parse_args(argv)
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    print(f"quantroute GPU check, {now}")
    try:
        nvml = NvmlProvider()
    except DeviceError as exc:
        smi = shutil.which(args.nvidia_smi)
        print(f"FAIL: no NVIDIA GPU usable here: {exc.message}")
        print(f"      nvidia-smi: {smi or 'not found on PATH'}")
        return EXIT_CANNOT_RUN
    try:
        nvml_devices = nvml.read()
        print(f"NVML: {len(nvml_devices)} GPU(s)")
        if shutil.which(args.nvidia_smi) is None:
            print(f"FAIL: {args.nvidia_smi} not found on PATH; cannot cross-check NVML")
            return EXIT_CANNOT_RUN
        try:
            smi_devices = SmiProvider(binary=args.nvidia_smi, detail_every=0).read()
        except DeviceError as exc:
            print(f"FAIL: {exc.message}")
            return EXIT_CANNOT_RUN
        print(f"nvidia-smi: {len(smi_devices)} GPU(s)")
        findings = compare_readings(nvml_devices, smi_devices)
        if not args.skip_alloc:
            findings += check_allocation(nvml)
    finally:
        nvml.close()
    for finding in findings:
        print(f"{'ok  ' if finding.ok else 'FAIL'}  {finding.line}")
    failed = [f for f in findings if not f.ok]
    print(f"RESULT: {'OK' if not failed else f'{len(failed)} check(s) failed'}")
    if any("cannot run" in f.line for f in failed):
        return EXIT_CANNOT_RUN
    return EXIT_MISMATCH if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""GPU serving on a real NVIDIA GPU (marked ``gpu``; skipped without one).

Run by ``scripts/gpu_check.sh`` after its NVML-vs-nvidia-smi comparison, and by
``scripts/gpu_all.sh`` (the one device call; docs/telemetry.md). Needs a CUDA build of
llama.cpp (``make`` builds one where there is a GPU and a toolkit; the GPU kit builds one
on the device) and, for the pressure test, PyTorch with CUDA.

- three branches of the demo model placed on one GPU, fully offloaded;
- NVML's per-process footprint of each worker vs the memory model's estimate;
- VRAM pressure by allocating with torch: default requests move to a cheaper
  branch within two poll intervals.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from qrtest import demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GiB = 1 << 30
POLL_S = 0.5


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    return out.returncode == 0 and out.stdout.startswith("GPU ")


if not _has_gpu():
    pytest.skip("no NVIDIA GPU on this machine", allow_module_level=True)


async def test_three_branches_share_one_gpu_and_follow_its_free_memory(tmp_path: Path) -> None:
    settings = load_settings(
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 2048},
        telemetry={"devices": "auto", "poll_interval_s": POLL_S},
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as (client, gateway):
        devices = (await client.get("/v1/devices")).json()
        gpu_branches = {
            b: v for b, v in devices["branches"].items() if str(v["device"]).startswith("cuda:")
        }
        print("placements:", {b: (v["device"], v["n_gpu_layers"]) for b, v in gpu_branches.items()})
        assert len(gpu_branches) == 3, devices["branches"]
        assert len({v["device"] for v in gpu_branches.values()}) == 1  # one GPU, shared
        assert all(v["n_gpu_layers"] == -1 and v["ready"] for v in gpu_branches.values())

        # footprints: NVML's per-process usage replaces the estimate after the warm-up
        for _ in range(100):
            devices = (await client.get("/v1/devices")).json()
            if all(v["footprint"]["measured_bytes"] for v in devices["branches"].values()):
                break
            await asyncio.sleep(0.1)
        for branch, v in devices["branches"].items():
            fp = v["footprint"]
            print(
                f"{branch}: measured {fp['measured_bytes']} B, estimated {fp['estimated_bytes']} B"
                f" ({fp['measured_bytes'] / fp['estimated_bytes'] - 1:+.0%})"
                if fp["measured_bytes"]
                else f"{branch}: not measured (NVML lists no memory for its pid)"
            )

        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("PyTorch has no CUDA here")
        ask = {"model": "tiny-llama", "prompt": "def ", "max_tokens": 2, "temperature": 0}
        first = await client.post("/v1/completions", json=ask)
        print("before pressure:", first.headers["x-quantroute-branch"])
        device = next(iter(gpu_branches.values()))["device"]
        index = int(device.partition(":")[2])
        snapshot = gateway.poller.snapshot.device(device)
        assert snapshot is not None
        # leave 2 GiB free for routing (tight), as another tenant would
        margin = snapshot.free_bytes - gateway.margin.headroom(snapshot)
        take = max(0, snapshot.free_bytes - margin - 2 * GiB)
        block = torch.empty(take, dtype=torch.uint8, device=f"cuda:{index}")
        try:
            started = asyncio.get_running_loop().time()
            while True:
                r = await client.post("/v1/completions", json=ask)
                if r.headers["x-quantroute-branch"] == "tiny-llama:q4_k_m":
                    break
                waited = asyncio.get_running_loop().time() - started
                assert waited < 2 * POLL_S + 0.5, "routing did not follow GPU memory"
                await asyncio.sleep(0.05)
            print(
                f"under pressure: {r.headers['x-quantroute-branch']} "
                f"({r.headers['x-quantroute-route-reason']}) after "
                f"{asyncio.get_running_loop().time() - started:.2f} s"
            )
        finally:
            del block
            torch.cuda.empty_cache()

"""GPU serving decisions, without a GPU: the fake NVML stands in for the driver.

Placement on ``cuda:N`` (full, partial, shared, or the CPU when the build can't
offload), what the worker is told (``--n-gpu-layers``, ``CUDA_VISIBLE_DEVICES``),
the footprint measured from NVML's per-process usage, and routing that follows
GPU free memory through the real app and real llama.cpp workers (the CPU
build ignores the offload, so the decisions are real and the decode runs here).
The same checks on a real GPU are in ``tests/gpu/`` (marked ``gpu``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qrtest import demo_model_dir, demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.llamacpp.engine import WorkerOptions
from quantroute.telemetry import CompositeProvider, CpuProvider, HealthTracker, NvmlProvider
from quantroute.telemetry.memory import CUDA_CONTEXT_BYTES
from quantroute.telemetry.occupancy import (
    Occupancy,
    PlacementRequest,
    layers_that_fit,
    partial_offload,
)
from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.poller import DevicePoller
from quantroute.telemetry.stats import DeviceKind
from quantroute.types import Offload

GiB = 1 << 30
MiB = 1 << 20
NO_MARGIN = MarginPolicy(min_bytes=0, fraction=0.0)
BRANCHES = ("f16", "q8_0", "q4_k_m")


def _requests() -> list[PlacementRequest]:
    return [PlacementRequest(f"tiny-llama:{b}", demo_model_dir() / f"{b}.gguf") for b in BRANCHES]


async def _occupancy(
    nvml: Any, *, gpu_offload: bool = True, n_gpu_layers: int = -1
) -> tuple[Occupancy, DevicePoller]:
    provider = CompositeProvider([NvmlProvider(nvml), CpuProvider()])
    poller = DevicePoller(provider, interval_s=1.0)
    await poller.poll_once()
    occupancy = Occupancy(
        poller,
        health=HealthTracker(),
        margin=NO_MARGIN,
        n_ctx=512,
        parallel=2,
        n_batch=512,
        n_gpu_layers=n_gpu_layers,
        gpu_offload=gpu_offload,
    )
    return occupancy, poller


async def test_branches_go_to_the_gpu_with_the_most_room_and_share_it(
    nvml_kit: SimpleNamespace,
) -> None:
    gpus = [
        nvml_kit.Gpu(bus_id="00000000:18:00.0", total=24 * GiB, used=20 * GiB),
        nvml_kit.Gpu(bus_id="00000000:3B:00.0", total=24 * GiB, used=1 * GiB, uuid="GPU-1"),
    ]
    occupancy, poller = await _occupancy(nvml_kit.Nvml(gpus))
    occupancy.place_all(_requests())
    placements = [occupancy.placements[f"tiny-llama:{b}"] for b in BRANCHES]
    assert {p.device for p in placements} == {"cuda:1"}  # all three share the roomier GPU
    for p in placements:
        assert p.offload == Offload(gpu=1, n_gpu_layers=-1)
        # the GPU memory model: weights, KV for n_ctx x parallel, compute, the CUDA context
        assert p.footprint.overhead_bytes == CUDA_CONTEXT_BYTES and p.footprint.runtime_bytes == 0
        assert p.footprint.kv_bytes > 0 and p.footprint.compute_bytes > 0
    await poller.stop()


async def test_without_a_cuda_build_or_with_offload_off_branches_stay_on_the_cpu(
    nvml_kit: SimpleNamespace,
) -> None:
    for kwargs in ({"gpu_offload": False}, {"n_gpu_layers": 0}):
        occupancy, poller = await _occupancy(nvml_kit.Nvml([nvml_kit.Gpu()]), **kwargs)
        occupancy.place_all(_requests())
        for p in occupancy.placements.values():
            assert p.device == "cpu" and p.offload == Offload(None, 0), kwargs
        await poller.stop()


async def test_a_branch_too_big_for_the_gpu_is_offloaded_partly(
    nvml_kit: SimpleNamespace,
) -> None:
    probe, poller = await _occupancy(nvml_kit.Nvml([nvml_kit.Gpu()]))
    full, _, n_layer = probe.estimate(demo_model_dir() / "f16.gguf", DeviceKind.CUDA)
    await poller.stop()
    fixed = full.compute_bytes + full.overhead_bytes
    per_layer = (full.weights_bytes + full.kv_bytes) / n_layer
    free = fixed + int(per_layer * (n_layer - 0.5))  # all layers but half of one fit
    gpu = nvml_kit.Gpu(total=free + 1 * GiB, used=1 * GiB)
    occupancy, poller = await _occupancy(nvml_kit.Nvml([gpu]))
    occupancy.place_all(_requests()[:1])
    p = occupancy.placements["tiny-llama:f16"]
    assert p.device == "cuda:0" and p.n_gpu_layers == n_layer - 1 == p.offload.n_gpu_layers
    assert p.footprint.bytes <= free < full.bytes
    await poller.stop()


async def test_a_reference_keeps_its_draft_only_where_both_fit(
    nvml_kit: SimpleNamespace,
) -> None:
    """Speculation is a way of serving the reference within memory: its draft's weights,
    cells and buffers are placed with it where they fit; where only the reference fits, it is
    placed alone (its worker starts without the draft, and the placement says why),
    never left unplaced for its draft's sake; a partial offload leaves no room either."""
    f16, q4 = demo_model_dir() / "f16.gguf", demo_model_dir() / "q4_k_m.gguf"
    probe, poller = await _occupancy(nvml_kit.Nvml([nvml_kit.Gpu()]))
    alone, _, _ = probe.estimate(f16, DeviceKind.CUDA)
    draft, _, _ = probe.estimate(q4, DeviceKind.CUDA)
    await poller.stop()
    # the draft's weights, cells and compute buffers: a second context has its own; the
    # process's runtime and CUDA context are shared
    both = alone.bytes + draft.weights_bytes + draft.kv_bytes + draft.compute_bytes
    request = PlacementRequest("tiny-llama:f16", f16, draft_path=q4)
    for free, drafted in ((both, True), (both - 1, False), (alone.bytes, False)):
        gpu = nvml_kit.Gpu(total=free + 1 * GiB, used=1 * GiB)
        occupancy, poller = await _occupancy(nvml_kit.Nvml([gpu]))
        occupancy.place_all([request])
        p = occupancy.placements["tiny-llama:f16"]
        assert p.device == "cuda:0" and p.n_gpu_layers == -1, free
        assert (p.draft_dropped is None) is drafted and p.offload.draft_dropped == p.draft_dropped
        assert p.footprint.bytes == (both if drafted else alone.bytes)
        if not drafted:
            assert p.draft_dropped == "its draft q4_k_m.gguf does not fit beside it on cuda:0"
        await poller.stop()
    gpu = nvml_kit.Gpu(total=alone.bytes - 1 + 1 * GiB, used=1 * GiB)  # a layer short
    occupancy, poller = await _occupancy(nvml_kit.Nvml([gpu]))
    occupancy.place_all([request])
    p = occupancy.placements["tiny-llama:f16"]
    assert p.device == "cuda:0" and p.n_gpu_layers > 0 and p.offload.draft_dropped is not None
    await poller.stop()


def test_partial_offload_scales_weights_and_kv_by_layer() -> None:
    from quantroute.telemetry.memory import Footprint

    fp = Footprint(weights_bytes=800, kv_bytes=200, compute_bytes=50, overhead_bytes=100)
    assert partial_offload(fp, 10, 5).bytes == 400 + 100 + 50 + 100
    assert partial_offload(fp, 10, 10).bytes == fp.bytes
    assert layers_that_fit(fp, 10, 150) == 0  # not even the fixed part
    assert layers_that_fit(fp, 10, 150 + 300) == 3
    assert layers_that_fit(fp, 10, 10_000) == 10


async def test_the_measured_gpu_footprint_replaces_the_estimate(
    nvml_kit: SimpleNamespace,
) -> None:
    gpu = nvml_kit.Gpu(total=24 * GiB, used=1 * GiB)
    occupancy, poller = await _occupancy(nvml_kit.Nvml([gpu]))
    occupancy.place_all(_requests())
    branch = "tiny-llama:q8_0"
    estimated = occupancy.placements[branch].footprint.bytes
    await occupancy.measure(branch, pid=4242)  # not listed by the driver: the estimate stays
    assert occupancy.placements[branch].footprint.measured_bytes is None
    gpu.processes = [(4242, 700 * MiB)]
    await occupancy.measure(branch, pid=4242)
    footprint = occupancy.placements[branch].footprint
    assert footprint.measured_bytes == 700 * MiB and footprint.bytes != estimated
    assert footprint.estimated_bytes == estimated
    await poller.stop()


def test_the_worker_is_told_its_gpu_and_layers() -> None:
    options = WorkerOptions(gpu=3, n_gpu_layers=-1)
    argv = options.argv(Path("/m.gguf"))
    assert argv[argv.index("--n-gpu-layers") + 1] == "-1"
    env = options.env()
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    cpu = WorkerOptions()
    assert cpu.argv(Path("/m.gguf"))[cpu.argv(Path("/m.gguf")).index("--n-gpu-layers") + 1] == "0"
    assert cpu.env()["CUDA_VISIBLE_DEVICES"] == ""  # a CPU worker sees no GPU


@pytest.mark.slow
async def test_the_server_places_on_the_gpu_and_routes_by_its_free_memory(
    tmp_path: Path, nvml_kit: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three branches on one (fake) GPU; the GPU fills up (another process allocates, as
    torch would) and default requests move to a cheaper branch within two poll intervals."""
    # The llama.cpp build here is a CPU one: the server would keep the branches on the CPU.
    # Stand in a CUDA build's answer; the workers then run with --n-gpu-layers -1, which the
    # CPU build ignores, so everything but the GPU itself is real.
    monkeypatch.setattr(
        "quantroute.api.parts.probe_build", lambda: SimpleNamespace(gpu_offload=True)
    )
    gpu = nvml_kit.Gpu(total=80 * GiB, used=1 * GiB)
    provider = CompositeProvider([NvmlProvider(nvml_kit.Nvml([gpu])), CpuProvider()])
    settings = load_settings(
        repo=demo_repo_copy(tmp_path, engine="llamacpp"),  # ONNX stays on the CPU
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 512},
        telemetry={"poll_interval_s": 0.5},
        routing={"residency": False},
    )
    async with serving(create_app(settings, provider=provider)) as (client, gateway):
        body = (await client.get("/v1/devices")).json()
        for b in BRANCHES:
            view = body["branches"][f"tiny-llama:{b}"]
            assert view["device"] == "cuda:0" and view["n_gpu_layers"] == -1 and view["ready"]
        engines = {b.name: b.engine for b in gateway.routes.current.branches()}
        assert all(e.options.gpu == 0 and e.options.n_gpu_layers == -1 for e in engines.values())

        # NVML lists the workers' memory: the measurement replaces the estimate
        gpu.processes = [(e.pid, 300 * MiB) for e in engines.values() if e.pid]
        for b in BRANCHES:
            await gateway.occupancy.measure(f"tiny-llama:{b}", engines[b].pid)
        body = (await client.get("/v1/devices")).json()
        assert body["branches"]["tiny-llama:f16"]["footprint"]["measured_bytes"] == 300 * MiB

        ask = {"model": "tiny-llama", "prompt": "def ", "max_tokens": 2, "temperature": 0}
        r = await client.post("/v1/completions", json=ask)
        assert r.headers["x-quantroute-branch"] == "tiny-llama:f16"  # ample: the reference

        # someone else took the GPU: 6 GiB free, 2 GiB free for routing after the 4 GiB margin
        gpu.used = 74 * GiB
        started = asyncio.get_running_loop().time()
        while True:
            r = await client.post("/v1/completions", json=ask)
            if r.headers["x-quantroute-branch"] == "tiny-llama:q4_k_m":
                break
            assert asyncio.get_running_loop().time() - started < 2 * 0.5 + 0.5
            await asyncio.sleep(0.05)
        assert r.headers["x-quantroute-route-reason"] == "best-fit:tight"


def _pinned(device: str) -> list[PlacementRequest]:
    return [
        PlacementRequest(f"tiny-llama:{b}", demo_model_dir() / f"{b}.gguf", device=device)
        for b in BRANCHES
    ]


async def test_a_branch_pinned_to_a_device_goes_there_or_nowhere(
    nvml_kit: SimpleNamespace,
) -> None:
    """A manifest's ``device:`` binds: the pinned GPU though the other has more room, the
    CPU though a GPU has room, and an unknown device, a full one or a GPU without offload
    fail the branch with the reason in words."""
    gpus = [
        nvml_kit.Gpu(bus_id="00000000:18:00.0", total=24 * GiB, used=20 * GiB),
        nvml_kit.Gpu(bus_id="00000000:3B:00.0", total=24 * GiB, used=1 * GiB, uuid="GPU-1"),
    ]
    occupancy, poller = await _occupancy(nvml_kit.Nvml(gpus))
    occupancy.place_all(_pinned("cuda:0"))  # the fuller GPU: unpinned, they go to cuda:1
    assert {p.device for p in occupancy.placements.values()} == {"cuda:0"}
    assert all(p.offload == Offload(gpu=0, n_gpu_layers=-1) for p in occupancy.placements.values())
    occupancy.place_all(_pinned("cpu"))
    assert all(p.device == "cpu" and p.offload == Offload(None, 0) and not p.problem
               for p in occupancy.placements.values())  # fmt: skip
    occupancy.place_all(_pinned("cuda:7"))
    for p in occupancy.placements.values():
        assert p.device is None
        assert p.problem == (
            "its manifest's device cuda:7 is not one of this server's (cpu, cuda:0, cuda:1)"
        )
    await poller.stop()

    full = nvml_kit.Gpu(total=24 * GiB, used=24 * GiB - 64 * MiB)  # room for nothing
    occupancy, poller = await _occupancy(nvml_kit.Nvml([full, nvml_kit.Gpu(uuid="GPU-1")]))
    occupancy.place_all(_pinned("cuda:0")[:1])
    p = occupancy.placements["tiny-llama:f16"]
    assert p.device is None and p.problem is not None
    assert p.problem.startswith("its manifest's device cuda:0: ") and "needs" in p.problem
    await poller.stop()

    occupancy, poller = await _occupancy(nvml_kit.Nvml([nvml_kit.Gpu()]), gpu_offload=False)
    occupancy.place_all(_pinned("cuda:0")[:1])
    p = occupancy.placements["tiny-llama:f16"]
    assert p.device is None and p.problem is not None and "offloads no layers" in p.problem
    await poller.stop()

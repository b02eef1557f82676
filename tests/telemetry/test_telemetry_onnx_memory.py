"""The memory model of an ONNX Runtime branch (``telemetry/memory_onnx.py``): the
estimate from the graph's interface and its tokenizer's metadata, placement on the CPU
only, the growth added to what the worker holds at ready, and — slow — the estimate
against the RSS of a real ONNX worker whose every slot is full."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from qrtest import demo_model_dir
from quantroute.errors import ConfigError
from quantroute.registry.onnx_check import OnnxSummary
from quantroute.registry.onnx_pair import check_onnx_isolated
from quantroute.telemetry import CompositeProvider, CpuProvider, HealthTracker, NvmlProvider
from quantroute.telemetry.memory import measure_process_rss
from quantroute.telemetry.memory_onnx import (
    ONNX_ARENA_SLACK,
    ONNX_ATTENTION_COPIES,
    ONNX_FLOAT16_COPIES,
    ONNX_SESSION_BYTES,
    ONNX_WEIGHT_COPIES,
    ONNX_WORKER_RUNTIME_BYTES,
    estimate_onnx_footprint,
    is_onnx,
    onnx_growth_bytes,
    onnx_step_tokens,
    read_onnx_shape,
)
from quantroute.telemetry.occupancy import Occupancy, PlacementRequest
from quantroute.telemetry.placement import MarginPolicy
from quantroute.telemetry.poller import DevicePoller

pytest.importorskip("onnx")

GiB, MiB = 1 << 30, 1 << 20
NO_MARGIN = MarginPolicy(min_bytes=0, fraction=0.0)
SHAPE = OnnxSummary(
    ir_version=10,
    n_nodes=100,
    n_tensors=50,
    weights_bytes=10 * MiB,
    float16_bytes=4 * MiB,
    quantized_matmuls=0,
    n_layer=8,
    n_kv_heads=2,
    head_dim=64,
    kv_bytes_per_token=8 * 2 * 2 * 64 * 4,
    kv_element_bytes=4,
    n_vocab=32000,
    n_ctx_train=1024,
    n_head=8,
    n_embd=512,
    n_ff=1536,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's F16 GGUF as an int8 ONNX folder, checked (its summary kept)."""
    from quantroute.demo.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "onnx_int8"
    export_onnx(demo_model_dir() / "f16.gguf", out, "int8")
    [found] = check_onnx_isolated([(out / "model.onnx", out / "tokenizer.gguf")])
    assert found.summary is not None, found
    return out


def _arena(nbytes: int) -> int:
    return round(ONNX_ARENA_SLACK * nbytes)


def test_the_estimate_is_weights_kv_steps_session_and_runtime() -> None:
    fp = estimate_onnx_footprint(SHAPE, 256, n_parallel=4, n_batch=512, runtime_bytes=7)
    assert fp.weights_bytes == round(ONNX_WEIGHT_COPIES * 10 * MiB)  # a float32 graph's
    assert fp.kv_bytes == SHAPE.kv_bytes_per_token * 256 * 4 == 8 * 2 * 2 * 64 * 4 * 1024
    tokens = 1024  # n_batch tokens, padded into one call of the slots: at most twice
    output = 4 * tokens * 32000  # the logits of every row: the largest phase here
    assert output > ONNX_ATTENTION_COPIES * 4 * tokens * 8 * 256 and output > 12 * tokens * 1536
    assert fp.compute_bytes == 2 * fp.kv_bytes + _arena(output)
    assert (fp.overhead_bytes, fp.runtime_bytes) == (ONNX_SESSION_BYTES, 7)
    assert onnx_growth_bytes(fp) == fp.kv_bytes + fp.compute_bytes
    # n_ctx 0 is the tokenizer's training context, as the worker reads it
    assert estimate_onnx_footprint(SHAPE, 0).kv_bytes == SHAPE.kv_bytes_per_token * 1024
    # a run is never more rows than the slots hold
    small = estimate_onnx_footprint(SHAPE, 16, n_parallel=2, n_batch=512)
    assert small.compute_bytes == 2 * small.kv_bytes + _arena(4 * 32 * 32000)


@pytest.mark.parametrize(
    ("n_ctx", "parallel", "n_batch", "tokens"),
    [(512, 1, 512, 512), (512, 2, 512, 1024), (512, 4, 512, 1024), (128, 4, 512, 512)],
)
def test_a_run_is_a_batch_padded_at_most_twice(
    n_ctx: int, parallel: int, n_batch: int, tokens: int
) -> None:
    assert onnx_step_tokens(n_ctx, parallel, n_batch) == tokens


W = round(ONNX_WEIGHT_COPIES * 10 * MiB)


@pytest.mark.parametrize(
    ("change", "weights", "phase"),
    [
        # a float16 graph: its float16 weights widened to float32 at load
        ({"kv_element_bytes": 2}, W + round(ONNX_FLOAT16_COPIES * 4 * MiB), 4 * 1024 * 32000),
        # MatMulNBits: its workspace for the head
        ({"quantized_matmuls": 57}, W, 4 * 1024 * 32000 + 2 * 512 * 32000),
        # logits_to_keep: a prompt's last row alone; every row only for a drift replay's
        # one sequence, at most n_batch (not the padded run of the slots)
        ({"keeps_rows": True}, W, 4 * 512 * 32000),
        # a small vocabulary and a long context: attention is the largest phase
        ({"n_vocab": 354}, W, ONNX_ATTENTION_COPIES * 4 * 1024 * 8 * 4096),
    ],
)
def test_the_graphs_kind_decides_its_weights_and_largest_phase(
    change: dict[str, int], weights: int, phase: float
) -> None:
    shape = replace(SHAPE, **change)
    n_ctx = 4096 if shape.n_vocab == 354 else 512
    fp = estimate_onnx_footprint(shape, n_ctx, n_parallel=2, n_batch=512)  # a run: 1024
    assert fp.weights_bytes == weights
    assert fp.compute_bytes == 2 * fp.kv_bytes + round(ONNX_ARENA_SLACK * phase)


def test_a_context_nobody_gives_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"set engine\.n_ctx"):
        estimate_onnx_footprint(replace(SHAPE, n_ctx_train=0), 0)
    assert estimate_onnx_footprint(replace(SHAPE, n_ctx_train=0), 64).kv_bytes > 0


def test_the_shape_comes_from_the_checked_graph_and_tokenizer(folder: Path) -> None:
    shape = read_onnx_shape(folder / "model.onnx")
    assert (shape.n_layer, shape.n_kv_heads, shape.head_dim, shape.n_vocab) == (2, 4, 64, 354)
    assert (shape.n_ctx_train, shape.n_head, shape.n_embd, shape.n_ff) == (512, 4, 256, 768)
    assert is_onnx(folder / "model.onnx") and not is_onnx(demo_model_dir() / "f16.gguf")
    not_a_graph = folder.parent / "not-a-graph.onnx"
    not_a_graph.write_bytes((folder / "tokenizer.gguf").read_bytes())
    with pytest.raises(ConfigError, match=r"cannot read ONNX graph not-a-graph\.onnx: not an"):
        read_onnx_shape(not_a_graph)


async def _occupancy(nvml: object) -> tuple[Occupancy, DevicePoller]:
    provider = CompositeProvider([NvmlProvider(nvml), CpuProvider()])
    poller = DevicePoller(provider, interval_s=1.0)
    await poller.poll_once()
    occupancy = Occupancy(
        poller,
        health=HealthTracker(),
        margin=NO_MARGIN,
        n_ctx=256,
        parallel=2,
        n_batch=512,
        gpu_offload=True,
    )
    return occupancy, poller


async def test_an_onnx_branch_is_placed_on_the_cpu_and_measured_with_its_growth(
    nvml_kit: SimpleNamespace, folder: Path
) -> None:
    occupancy, poller = await _occupancy(nvml_kit.Nvml([nvml_kit.Gpu(total=24 * GiB)]))
    occupancy.place_all(
        [
            PlacementRequest("tiny-llama:f16", demo_model_dir() / "f16.gguf"),
            PlacementRequest("tiny-llama:onnx_int8", folder / "model.onnx"),
            PlacementRequest("tiny-llama:pinned", folder / "model.onnx", device="cuda:0"),
        ]
    )
    gguf = occupancy.placements["tiny-llama:f16"]
    onnx = occupancy.placements["tiny-llama:onnx_int8"]
    assert gguf.device == "cuda:0"  # the GGUF branch offloads; the ONNX one stays on the CPU
    assert onnx.device == "cpu" and onnx.offload.gpu is None and onnx.n_gpu_layers == 0
    shape = read_onnx_shape(folder / "model.onnx")
    expected = estimate_onnx_footprint(
        shape, 256, n_parallel=2, n_batch=512, runtime_bytes=ONNX_WORKER_RUNTIME_BYTES
    )
    assert onnx.footprint == expected and onnx.kv_bytes_per_token == shape.kv_bytes_per_token
    assert onnx.grows_bytes == expected.kv_bytes + expected.compute_bytes > 0
    pinned = occupancy.placements["tiny-llama:pinned"]
    assert pinned.device is None and pinned.problem is not None
    assert "an ONNX Runtime branch runs on the CPU here" in pinned.problem
    # measured at ready: its RSS then, and the KV cells and step buffers still to come
    before = measure_process_rss(os.getpid())
    await occupancy.measure("tiny-llama:onnx_int8", os.getpid())
    measured = occupancy.placements["tiny-llama:onnx_int8"].footprint.measured_bytes
    after = measure_process_rss(os.getpid())
    assert measured is not None and before + onnx.grows_bytes <= measured
    assert measured <= after + onnx.grows_bytes
    await poller.stop()


# (model, precision, repeats of the prompt's line: about 420 of the 512 cells)
FULL_WORKERS = [("tiny-llama", p, 15) for p in ("fp32", "fp16", "int8", "int4")]
FULL_WORKERS += [("stdlib-bpe-llama", p, 38) for p in ("fp16", "int4")]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "precision", "repeats"), FULL_WORKERS)
async def test_the_estimate_is_within_25_percent_of_a_full_onnx_worker(
    tmp_path: Path, model: str, precision: str, repeats: int
) -> None:
    """A real worker (``LlamaCppEngine``, ``backend="onnx"``) on folders exported from the
    demo models, both slots filled with long prompts (the worker pads them into one
    call), then a drift replay's teacher-forced sequence (every row of logits): its peak
    RSS (``VmHWM``: the load and every step) against the estimate with the worker's
    runtime."""
    from quantroute.demo.onnx_export import export_onnx
    from quantroute.engines.base import GenerationRequest, SamplingParams
    from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
    from quantroute.engines.supervisor import RestartPolicy

    if "backend" not in WorkerOptions.__dataclass_fields__:
        pytest.skip("the ONNX worker (WorkerOptions.backend) is not in yet")
    pytest.importorskip("onnxruntime")
    if model == "tiny-llama":
        gguf = demo_model_dir() / "f16.gguf"
    else:
        from qrtest import realistic_repo

        gguf = realistic_repo() / model / "f16.gguf"
    out = tmp_path / f"onnx_{precision}"
    export_onnx(gguf, out, precision)
    [found] = check_onnx_isolated([(out / "model.onnx", out / "tokenizer.gguf")])
    assert found.summary is not None
    n_ctx, parallel, n_batch = 512, 2, 512
    estimate = estimate_onnx_footprint(
        found.summary,
        n_ctx,
        n_parallel=parallel,
        n_batch=n_batch,
        runtime_bytes=ONNX_WORKER_RUNTIME_BYTES,
    ).estimated_bytes
    options = WorkerOptions(
        backend="onnx", n_ctx=n_ctx, parallel=parallel, n_batch=n_batch, n_threads=1
    )
    engine = LlamaCppEngine(
        f"{model}:onnx_{precision}",
        out / "model.onnx",
        options,
        RestartPolicy(backoff_s=0.1, backoff_max_s=0.5),
        tokenizer=out / "tokenizer.gguf",
    )
    await engine.start()
    assert engine.ready, engine.failure

    async def fill(i: int) -> None:
        prompt = f"# {i}\n" + "def f(x):\n    return x * 2\n" * repeats
        params = SamplingParams(max_tokens=64, temperature=0.0)
        async for _ in engine.generate(GenerationRequest(f"r{i}", prompt, params)):
            pass

    try:
        await asyncio.gather(*(fill(i) for i in range(parallel)))
        # a drift replay: one sequence teacher-forced, every row of logits written
        text = "def g(y):\n    return y + 1\n" * 60
        await engine.write_logits("", [], tmp_path / "reference.f32", text=text, limit=480)
        assert engine.pid is not None
        peak = _peak_rss(engine.pid)  # the worker's high-water mark: load and every step
    finally:
        await engine.stop()
    error = (estimate - peak) / peak
    print(f"{model} onnx_{precision}: estimate {estimate / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB")
    assert abs(error) < 0.25, (precision, estimate, peak, error)


def _peak_rss(pid: int) -> int:
    """``VmHWM``: the most the process ever held resident."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
async def test_the_gateway_places_measures_and_serves_an_onnx_branch(tmp_path: Path) -> None:
    """The whole way: the scan checks the folder, the table builds its worker, placement
    puts it on the CPU, its footprint is measured with its growth, /v1/models names its
    engine, and a pinned request is answered by it."""
    import yaml

    from qrtest import demo_repo_copy, serving
    from quantroute.api.app import create_app
    from quantroute.config import load_settings
    from quantroute.demo.onnx_export import export_onnx
    from quantroute.engines.llamacpp.engine import WorkerOptions
    from quantroute.registry.manifest import sha256_file

    if "backend" not in WorkerOptions.__dataclass_fields__:
        pytest.skip("the ONNX worker (WorkerOptions.backend) is not in yet")
    pytest.importorskip("onnxruntime")
    repo = demo_repo_copy(tmp_path)
    model_dir = repo / "tiny-llama"
    export_onnx(model_dir / "f16.gguf", model_dir / "onnx_int4", "int4")
    manifest = yaml.safe_load((model_dir / "quantroute.yaml").read_text())
    manifest["branches"]["onnx_int4"] = {
        "engine": "onnxruntime",
        "file": "onnx_int4/model.onnx",
        "precision": "int4",
        "sha256": sha256_file(model_dir / "onnx_int4" / "model.onnx"),
        "tokenizer": {
            "file": "onnx_int4/tokenizer.gguf",
            "sha256": sha256_file(model_dir / "onnx_int4" / "tokenizer.gguf"),
        },
    }
    (model_dir / "quantroute.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    settings = load_settings(
        repo=repo,
        telemetry={"devices": "cpu"},
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 256},
        routing={"residency": False},
    )
    async with serving(create_app(settings)) as (client, gateway):
        body = (await client.get("/v1/models")).json()
        model = next(m for m in body["data"] if m["id"] == "tiny-llama")
        branch = next(b for b in model["branches"] if b["branch"] == "onnx_int4")
        assert branch["engine"] == "onnxruntime" and branch["precision"] == "int4"
        assert branch["state"] == "ready", branch["failure"]
        placement = gateway.occupancy.placements["tiny-llama:onnx_int4"]
        assert placement.device == "cpu" and placement.grows_bytes > 0
        for _ in range(100):  # measured once the engine says ready
            if placement.footprint.measured_bytes is not None:
                break
            await asyncio.sleep(0.05)
            placement = gateway.occupancy.placements["tiny-llama:onnx_int4"]
        measured = placement.footprint.measured_bytes
        assert measured is not None and measured > placement.grows_bytes
        assert abs(placement.footprint.error_fraction or 1.0) < 0.25
        answer = await client.post(
            "/v1/completions",
            json={"model": "tiny-llama:onnx_int4", "prompt": "def ", "max_tokens": 8},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-quantroute-artifact"] == branch["sha256"][:16]

"""The memory model: GGUF shapes, KV and compute formulas, footprints, margins, RSS."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from quantroute.errors import ConfigError
from quantroute.telemetry import (
    DeviceKind,
    DeviceStats,
    Footprint,
    GpuProcess,
    estimate_footprint,
    free_for_routing,
    kv_cache_bytes,
    measure_process_rss,
    process_gpu_bytes,
    read_model_shape,
    safety_margin_bytes,
    torch_fragmentation_bytes,
    used_delta,
)
from quantroute.telemetry.memory import llamacpp_compute_bytes, llamacpp_kv_cells

MiB = 1 << 20
GiB = 1 << 30


def test_read_model_shape(make_gguf: Callable[..., Path]) -> None:
    path = make_gguf(n_embd=64, n_layer=3, n_head=4, n_head_kv=1, n_ff=192, extra_vocab=41)
    shape = read_model_shape(path)
    assert (shape.arch, shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv) == (
        "llama",
        3,
        64,
        4,
        1,
    )
    assert (shape.head_dim_k, shape.n_embd_k, shape.n_ff, shape.n_vocab) == (16, 16, 192, 300)
    assert shape.n_ctx_train == 2048
    # F16 matrices + F32 norms, straight from the tensor table
    matrices = 2 * 300 * 64 + 3 * (64 * 64 * 2 + 16 * 64 * 2 + 3 * 192 * 64)
    norms = 64 + 3 * 2 * 64
    assert shape.weights_bytes == 2 * matrices + 4 * norms
    assert shape.n_tensors == 3 + 3 * 9


def test_read_model_shape_rejects_non_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="cannot read GGUF"):
        read_model_shape(bad)


@pytest.mark.parametrize(
    ("n_ctx", "n_parallel", "kv_type", "expected"),
    [
        # n_ctx x n_layer(4) x n_head_kv(2) x head_dim(32) x 2 (K and V) x bytes
        (512, 1, "f16", 512 * 4 * 2 * 32 * 2 * 2),
        (512, 4, "f16", 4 * 512 * 4 * 2 * 32 * 2 * 2),
        (1000, 1, "f32", 1000 * 4 * 2 * 32 * 2 * 4),
        (512, 1, "q8_0", 512 * 4 * 2 * 32 * 2 * 34 // 32),
    ],
)
def test_kv_cache_bytes(
    make_gguf: Callable[..., Path], n_ctx: int, n_parallel: int, kv_type: str, expected: int
) -> None:
    shape = read_model_shape(make_gguf())
    assert kv_cache_bytes(shape, n_ctx, n_parallel=n_parallel, kv_type=kv_type) == expected


def test_unknown_kv_type(make_gguf: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="q3_x"):
        kv_cache_bytes(read_model_shape(make_gguf()), 512, kv_type="q3_x")


@pytest.mark.parametrize(
    ("n_ctx", "cells"), [(1, 256), (128, 256), (256, 256), (257, 512), (2048, 2048)]
)
def test_llamacpp_pads_kv_cells(n_ctx: int, cells: int) -> None:
    assert llamacpp_kv_cells(n_ctx) == cells


# compute buffer sizes llama.cpp 0.3.36 printed ("CPU compute buffer size = X MiB") for
# models of these shapes (n_embd, n_head, n_head_kv, n_ff, extra vocab), n_kv, n_ubatch
COMPUTE_CASES = [
    # flash attention off (llama-cpp-python's Llama default)
    ((128, 4, 2, 384, 0), 512, 512, False, 6.51),
    ((128, 4, 2, 384, 0), 2048, 512, False, 21.51),
    ((256, 8, 8, 768, 0), 1024, 512, False, 21.51),
    ((256, 4, 4, 1024, 0), 512, 512, False, 9.51),  # the feed-forward phase dominates
    ((128, 4, 2, 384, 7741), 512, 512, False, 16.38),  # the output phase (8000 tokens)
    # flash attention on (llama.cpp's default, "auto", on CPU)
    ((128, 4, 2, 384, 0), 2048, 512, True, 5.26),
    ((256, 8, 8, 768, 0), 1024, 512, True, 7.51),
    ((256, 4, 4, 1024, 0), 512, 512, True, 8.51),
    ((128, 4, 2, 384, 0), 256, 256, True, 1.76),
    ((128, 4, 2, 384, 7741), 512, 512, True, 16.13),
]


@pytest.mark.parametrize(("dims", "n_kv", "n_ubatch", "flash_attn", "reported_mib"), COMPUTE_CASES)
def test_compute_buffer_matches_llamacpp_reservation(
    make_gguf: Callable[..., Path],
    dims: tuple[int, int, int, int, int],
    n_kv: int,
    n_ubatch: int,
    flash_attn: bool,
    reported_mib: float,
) -> None:
    n_embd, n_head, n_head_kv, n_ff, extra = dims
    shape = read_model_shape(
        make_gguf(n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, extra_vocab=extra)
    )
    # the reservation llama.cpp prints is the GPU-style worst case: every token an output
    buffer = llamacpp_compute_bytes(
        shape, n_kv, n_ubatch, flash_attn=flash_attn, device=DeviceKind.CUDA
    )
    assert buffer / MiB == pytest.approx(reported_mib, rel=0.05)


def test_flash_attention_and_parallel_sequences(make_gguf: Callable[..., Path]) -> None:
    shape = read_model_shape(make_gguf())
    with_fa = estimate_footprint(shape, 2048, flash_attn=True)
    without = estimate_footprint(shape, 2048, flash_attn=False)
    assert with_fa.compute_bytes < without.compute_bytes / 3  # no n_head x n_kv scores
    split = estimate_footprint(shape, 512, n_parallel=4)
    unified = estimate_footprint(shape, 512, n_parallel=4, kv_unified=True)
    assert split.kv_bytes == unified.kv_bytes == 4 * estimate_footprint(shape, 512).kv_bytes
    assert split.compute_bytes < unified.compute_bytes  # each sequence attends to its own cells


def test_footprint_estimate_parts(make_gguf: Callable[..., Path]) -> None:
    shape = read_model_shape(make_gguf())
    fp = estimate_footprint(shape, 300)
    assert fp.weights_bytes == shape.weights_bytes
    assert fp.kv_bytes == kv_cache_bytes(shape, 512)  # 300 cells padded to 512
    assert (
        fp.estimated_bytes == fp.weights_bytes + fp.kv_bytes + fp.compute_bytes + fp.overhead_bytes
    )
    serving = estimate_footprint(shape, 2048)
    profiling = estimate_footprint(shape, 2048, logits_all=True)
    assert profiling.compute_bytes >= serving.compute_bytes
    gpu = estimate_footprint(shape, 2048, device=DeviceKind.CUDA)
    assert gpu.overhead_bytes >= 256 * MiB  # a CUDA context
    with pytest.raises(ValueError):
        estimate_footprint(shape, 0)


def test_footprint_measurement_and_span() -> None:
    fp = Footprint(weights_bytes=800, kv_bytes=200, compute_bytes=50, overhead_bytes=30)
    assert fp.bytes == fp.estimated_bytes == 1080 and fp.error_fraction is None
    measured = fp.with_measurement(1200)
    assert measured.bytes == 1200 and measured.estimated_bytes == 1080
    assert measured.error_fraction == pytest.approx(-0.1)
    assert fp.per_device(1) == 1080
    assert fp.per_device(2) == 500 + 50 + 30  # weights and KV split, buffers on both
    assert measured.per_device(2) == pytest.approx(580 * 1200 / 1080, abs=1)
    with pytest.raises(ValueError):
        fp.per_device(0)


def test_footprint_far_off_measurement_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    Footprint(100, 0, 0, 0).with_measurement(200)
    assert "off by -50%" in caplog.text


@pytest.mark.parametrize(
    ("total", "free", "frag", "expected"),
    [
        (80 * GiB, 50 * GiB, 0, 50 * GiB - 4 * GiB),  # 5 % of 80 GiB beats 128 MiB
        (1 * GiB, 800 * MiB, 0, 800 * MiB - 128 * MiB),  # the 128 MiB floor
        (80 * GiB, 50 * GiB, 6 * GiB, 40 * GiB),  # fragmentation penalty
        (1 * GiB, 100 * MiB, 0, 0),  # never negative
    ],
)
def test_free_for_routing(total: int, free: int, frag: int, expected: int) -> None:
    device = DeviceStats("cuda:0", DeviceKind.CUDA, "gpu", total, total - free, free)
    assert free_for_routing(device, fragmentation_bytes=frag) == expected


def test_free_for_routing_of_unhealthy_device_is_zero() -> None:
    device = DeviceStats("cuda:0", DeviceKind.CUDA, "gpu", GiB, 0, GiB, healthy=False)
    assert free_for_routing(device) == 0
    assert safety_margin_bytes(10 * GiB, min_bytes=0, fraction=0.1) == GiB


def test_torch_fragmentation_from_memory_stats() -> None:
    stats = {"reserved_bytes.all.current": 6 * GiB, "allocated_bytes.all.current": 4 * GiB}
    assert torch_fragmentation_bytes(stats) == 2 * GiB
    assert torch_fragmentation_bytes({}) == 0


def test_gpu_measurements_from_readings() -> None:
    before = DeviceStats("cuda:0", DeviceKind.CUDA, "gpu", 8 * GiB, 1 * GiB, 7 * GiB)
    after = DeviceStats(
        "cuda:0",
        DeviceKind.CUDA,
        "gpu",
        8 * GiB,
        3 * GiB,
        5 * GiB,
        processes=(GpuProcess(77, 2 * GiB), GpuProcess(78, None)),
    )
    assert used_delta(before, after) == 2 * GiB
    assert process_gpu_bytes(after, 77) == 2 * GiB
    assert process_gpu_bytes(after, 78) is None and process_gpu_bytes(after, 79) is None
    with pytest.raises(ValueError):
        used_delta(before, DeviceStats("cuda:1", DeviceKind.CUDA, "gpu", 1, 0, 1))


def test_measure_process_rss_sees_a_child_grow() -> None:
    code = "import sys; b = bytearray(64 << 20); print('ready', flush=True); sys.stdin.read()"
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        assert measure_process_rss(child.pid) > 64 * MiB
        child.stdin.close()
        child.wait(timeout=10)
    with pytest.raises(ProcessLookupError):
        measure_process_rss(child.pid)

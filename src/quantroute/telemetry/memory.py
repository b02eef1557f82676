"""The memory model: what a branch costs on a device, before and after it loads.

A branch's footprint is its weights, its KV cache, the engine's compute
buffers and a fixed overhead (see ``docs/memory-model.md`` for every formula
and the measurements behind the constants). It is *estimated* from GGUF
metadata before loading (read by the registry's bounded header check, in a
child process: never by this one) and *measured* after (RSS of the worker
process on CPU, NVML on GPU); the measurement replaces the estimate once it
exists.

Free-for-routing is a device's free memory minus a safety margin
(``max(128 MiB, 5 % of total)``) minus the allocator fragmentation the engine
reports (PyTorch: reserved - allocated).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from quantroute.errors import ArtifactIntegrityError, ConfigError
from quantroute.registry.gguf_check import GgufSummary, read_gguf_isolated
from quantroute.telemetry.stats import DeviceKind, DeviceStats

logger = logging.getLogger(__name__)

MiB = 1 << 20

# llama.cpp rounds the KV cache up to a multiple of 256 cells (at least 256).
LLAMACPP_KV_PAD = 256
# Measured on llama-cpp-python 0.3.36 (CPU, flash attention on and off): resident
# memory of a context beyond weights, KV and compute buffers — graph metadata,
# threadpool, sampler — plus per-vocabulary-entry tokenizer tables.
LLAMACPP_CPU_OVERHEAD_BYTES = 9 * MiB // 2
LLAMACPP_BYTES_PER_VOCAB_ENTRY = 180
# What a worker process costs before it loads a model: the interpreter, numpy,
# llama_cpp, ggml, msgspec and the worker's modules (44 MiB measured on x86-64 Linux,
# CPython 3.11; tests/core/test_layout.py keeps the gateway's side out of it).
WORKER_RUNTIME_BYTES = 48 * MiB
# A CUDA context (driver, cuBLAS workspace, kernels); uncalibrated, from
# typical nvidia-smi readings of an idle PyTorch/llama.cpp process.
CUDA_CONTEXT_BYTES = 512 * MiB

# Bytes per element of a KV cache type (block scales included).
KV_BYTES_PER_ELEMENT: Mapping[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the memory model needs from a GGUF file's metadata and tensor table."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_ff: int
    n_vocab: int
    weights_bytes: int
    n_tensors: int

    @property
    def n_embd_k(self) -> int:
        """Width of one token's keys in one layer: ``n_head_kv * head_dim_k``."""
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_head_kv * self.head_dim_v


def read_model_shape(path: Path | str) -> ModelShape:
    """Read a GGUF file's shape: its metadata and tensor table, read by the registry's
    bounded header check in a child process bounded in time and memory
    (:func:`~quantroute.registry.gguf_check.read_gguf_isolated`), so that no model file's
    metadata — a million-entry array, a gigabyte string — costs the gateway's own memory
    or time. A file the repository scan checked is not read again (the scan's check kept
    its metadata while its size, mtime and ctime are the ones checked).

    Raises :class:`~quantroute.errors.ConfigError` when the file is not GGUF (or not a
    sound one), or lacks a key the model needs. Blocking: call it off the event loop.
    """
    path = Path(path)
    try:
        summary = read_gguf_isolated(path)
    except ArtifactIntegrityError as exc:
        raise ConfigError(f"cannot read GGUF file {path.name}: {exc.message}") from None
    return model_shape(summary, path.name)


def model_shape(summary: GgufSummary, name: str = "the GGUF file") -> ModelShape:
    """The :class:`ModelShape` of a header the bounded check read with its metadata."""
    fields = summary.metadata

    def get(key: str, default: int | None = None) -> int:
        value = fields.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)  # a per-layer array's largest element, when it is an array
        if default is None:
            raise ConfigError(f"{name}: GGUF metadata lacks {key}")
        return default

    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{name}: GGUF metadata lacks general.architecture")
    n_embd = get(f"{arch}.embedding_length")
    n_head = get(f"{arch}.attention.head_count")
    n_head_kv = get(f"{arch}.attention.head_count_kv", n_head)
    head_dim = n_embd // n_head if n_head else 0
    n_vocab = get(f"{arch}.vocab_size", get("tokenizer.ggml.tokens#count", 0))
    return ModelShape(
        arch=arch,
        n_layer=get(f"{arch}.block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=get(f"{arch}.attention.key_length", head_dim),
        head_dim_v=get(f"{arch}.attention.value_length", head_dim),
        n_ctx_train=get(f"{arch}.context_length", 0),
        n_ff=get(f"{arch}.feed_forward_length", 4 * n_embd),
        n_vocab=n_vocab,
        weights_bytes=summary.weights_bytes,
        n_tensors=summary.n_tensors,
    )


def kv_cache_bytes(
    shape: ModelShape, n_ctx: int, *, n_parallel: int = 1, kv_type: str = "f16"
) -> int:
    """``n_ctx * n_parallel * n_layer * n_head_kv * (head_dim_k + head_dim_v) * bytes/element``.

    With ``head_dim_k == head_dim_v`` this is the textbook
    ``n_ctx * n_layer * n_head_kv * head_dim * 2 * bytes``; ``n_ctx`` is per sequence.
    """
    try:
        per_element = KV_BYTES_PER_ELEMENT[kv_type]
    except KeyError:
        raise ValueError(f"unknown KV cache type {kv_type!r}") from None
    cells = n_ctx * n_parallel
    return math.ceil(cells * shape.n_layer * (shape.n_embd_k + shape.n_embd_v) * per_element)


def llamacpp_kv_cells(n_ctx: int) -> int:
    """The KV cells llama.cpp allocates for ``n_ctx``: rounded up to a multiple of 256."""
    return max(LLAMACPP_KV_PAD, -(-n_ctx // LLAMACPP_KV_PAD) * LLAMACPP_KV_PAD)


def llamacpp_compute_bytes(
    shape: ModelShape,
    n_kv: int,
    n_ubatch: int,
    *,
    n_outputs: int = 1,
    flash_attn: bool = True,
    device: DeviceKind = DeviceKind.CPU,
) -> int:
    """llama.cpp's compute buffer, as ggml's allocator sizes it (see ``docs/memory-model.md``).

    The buffer holds the largest phase of the graph for a micro-batch of
    ``n_ubatch`` tokens attending over ``n_kv`` cells, in f32 per token.
    Flash attention off (llama-cpp-python's ``Llama`` default)::

        attention   n_kv*(n_head + 1) + 5*n_embd + 2*n_embd_kv   (scores per head, mask, Q/K/V)
        ffn         n_kv + 4*n_ff + n_embd/2
        output      n_vocab*n_outputs/n_ubatch + 3*n_embd        (logits of requested outputs)

    plus, on CPU, a work buffer holding the scores in f16 for the product with
    V: ``2 * n_kv * n_ubatch * n_head`` bytes. Flash attention on (llama.cpp's
    default on CPU, "auto"; the scores are never materialised, the mask is f16)::

        attention   n_kv/2 + 4*n_embd + 2*n_embd_kv
        ffn         n_kv/2 + 3*n_ff + 4*n_embd
        output      n_vocab*n_outputs/n_ubatch + 2*n_embd

    ``n_outputs`` is the number of tokens whose logits are requested: 1 per
    sequence when serving, ``n_ubatch`` with ``logits_all`` (perplexity, KLD
    profiling). On CPU only touched pages become resident, so the output phase
    counts ``n_outputs`` rows; on GPU the whole reservation (``n_ubatch`` rows)
    is allocated.
    """
    if device is not DeviceKind.CPU:
        n_outputs = n_ubatch
    e, kv_width = shape.n_embd, shape.n_embd_k
    if flash_attn:
        attention = n_ubatch * (n_kv // 2 + 4 * e + 2 * kv_width)
        ffn = n_ubatch * (n_kv // 2 + 3 * shape.n_ff + 4 * e)
        output = n_outputs * shape.n_vocab + n_ubatch * 2 * e
        work = 0
    else:
        attention = n_ubatch * (n_kv * (shape.n_head + 1) + 5 * e + 2 * kv_width)
        ffn = n_ubatch * (n_kv + 4 * shape.n_ff + e // 2)
        output = n_outputs * shape.n_vocab + n_ubatch * 3 * e
        work = 2 * n_kv * n_ubatch * shape.n_head if device is DeviceKind.CPU else 0
    return 4 * max(attention, ffn, output) + work


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a branch costs on one device, estimated and (once loaded) measured, in bytes.

    >>> fp = Footprint(weights_bytes=100, kv_bytes=20, compute_bytes=10, overhead_bytes=5)
    >>> fp.estimated_bytes, fp.bytes, fp.with_measurement(150).bytes
    (135, 135, 150)
    """

    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    runtime_bytes: int = 0
    measured_bytes: int | None = None

    @property
    def estimated_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.kv_bytes
            + self.compute_bytes
            + self.overhead_bytes
            + self.runtime_bytes
        )

    @property
    def bytes(self) -> int:
        """The figure to route on: the measurement when there is one, else the estimate."""
        return self.measured_bytes if self.measured_bytes is not None else self.estimated_bytes

    @property
    def error_fraction(self) -> float | None:
        """``(estimated - measured) / measured``; ``None`` before measurement."""
        if not self.measured_bytes:
            return None
        return (self.estimated_bytes - self.measured_bytes) / self.measured_bytes

    def with_measurement(self, measured_bytes: int) -> Footprint:
        """A copy carrying the measurement; logs when the estimate was off by more than 25 %."""
        updated = replace(self, measured_bytes=int(measured_bytes))
        error = updated.error_fraction
        if error is not None and abs(error) > 0.25:
            logger.warning(
                "footprint estimate %d B off by %+.0f%% from measured %d B",
                self.estimated_bytes,
                100 * error,
                measured_bytes,
            )
        return updated

    def per_device(self, span: int) -> int:
        """Bytes needed on each of ``span`` devices: weights and KV split, buffers on each."""
        if span < 1:
            raise ValueError(f"span must be ≥ 1, got {span}")
        if span == 1:
            return self.bytes
        scale = self.bytes / self.estimated_bytes if self.estimated_bytes else 1.0
        split = math.ceil((self.weights_bytes + self.kv_bytes) / span)
        each = split + self.compute_bytes + self.overhead_bytes + self.runtime_bytes
        return math.ceil(each * scale)


def estimate_footprint(
    shape: ModelShape,
    n_ctx: int,
    *,
    n_parallel: int = 1,
    kv_unified: bool = False,
    n_batch: int = 512,
    n_ubatch: int = 512,
    kv_type: str = "f16",
    flash_attn: bool = True,
    logits_all: bool = False,
    device: DeviceKind = DeviceKind.CPU,
    runtime_bytes: int = 0,
) -> Footprint:
    """Estimate a llama.cpp branch's footprint before loading it.

    ``n_ctx`` is per sequence; ``n_parallel`` sequences each own ``n_ctx``
    cells unless ``kv_unified`` (then they share ``n_ctx * n_parallel`` and
    attention spans all of them). ``flash_attn`` defaults to llama.cpp's own
    default on CPU ("auto", which enables it); llama-cpp-python's ``Llama``
    class turns it off unless asked. Pass ``runtime_bytes=WORKER_RUNTIME_BYTES``
    to compare with a worker process's whole RSS.
    """
    if n_ctx < 1 or n_parallel < 1:
        raise ValueError("n_ctx and n_parallel must be >= 1")
    total_cells = llamacpp_kv_cells(n_ctx * n_parallel)
    attended = total_cells if kv_unified or n_parallel == 1 else llamacpp_kv_cells(n_ctx)
    # llama-cpp-python caps the batch at the requested context, then the micro-batch at the batch.
    ubatch = min(n_ubatch, n_batch, n_ctx * n_parallel)
    kv = kv_cache_bytes(shape, total_cells, kv_type=kv_type)
    compute = llamacpp_compute_bytes(
        shape,
        attended,
        ubatch,
        n_outputs=ubatch if logits_all else n_parallel,
        flash_attn=flash_attn,
        device=device,
    )
    if device is DeviceKind.CPU:
        overhead = LLAMACPP_CPU_OVERHEAD_BYTES + LLAMACPP_BYTES_PER_VOCAB_ENTRY * shape.n_vocab
    else:
        overhead = CUDA_CONTEXT_BYTES
    return Footprint(
        weights_bytes=shape.weights_bytes,
        kv_bytes=kv,
        compute_bytes=compute,
        overhead_bytes=overhead,
        runtime_bytes=runtime_bytes,
    )


def measure_process_rss(pid: int) -> int:
    """Resident set size of a process, in bytes (psutil). Raises ``ProcessLookupError``
    when the process is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess as exc:
        raise ProcessLookupError(pid) from exc


def process_gpu_bytes(device: DeviceStats, pid: int) -> int | None:
    """GPU memory ``pid`` holds on ``device`` as the driver reports it; ``None`` if not listed
    or hidden (then use :func:`used_delta` between readings before and after loading)."""
    for proc in device.processes:
        if proc.pid == pid:
            return proc.used_bytes
    return None


def used_delta(before: DeviceStats, after: DeviceStats) -> int:
    """How much a device's used memory grew between two readings (NVML delta on GPU)."""
    if before.id != after.id:
        raise ValueError(f"readings of different devices: {before.id} vs {after.id}")
    return after.used_bytes - before.used_bytes


def safety_margin_bytes(
    total_bytes: int, *, min_bytes: int = 128 * MiB, fraction: float = 0.05
) -> int:
    """``max(min_bytes, fraction * total)``: memory never handed to a branch."""
    return max(min_bytes, math.ceil(fraction * total_bytes))


def torch_fragmentation_bytes(memory_stats: Mapping[str, Any]) -> int:
    """Reserved - allocated from ``torch.cuda.memory_stats()``: cached blocks PyTorch holds
    but a new allocation may not fit into."""
    reserved = int(memory_stats.get("reserved_bytes.all.current", 0))
    allocated = int(memory_stats.get("allocated_bytes.all.current", 0))
    return max(0, reserved - allocated)


def free_for_routing(
    device: DeviceStats,
    *,
    fragmentation_bytes: int = 0,
    min_margin_bytes: int = 128 * MiB,
    margin_fraction: float = 0.05,
) -> int:
    """free - safety margin - fragmentation penalty, never below 0; 0 for an unhealthy device."""
    if not device.healthy:
        return 0
    margin = safety_margin_bytes(
        device.total_bytes, min_bytes=min_margin_bytes, fraction=margin_fraction
    )
    return max(0, device.free_bytes - margin - max(0, fragmentation_bytes))

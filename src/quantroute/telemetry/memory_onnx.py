"""The memory model of an ONNX Runtime branch (``engine: onnxruntime``).

Its worker is the llama.cpp worker with ONNX Runtime's forward pass
(``engines/onnx/worker_model.py``), on the CPU execution provider. What it
holds, estimated before it loads from the graph's interface and its
tokenizer's metadata (``registry.onnx_check.OnnxSummary``, read in the
registry's bounded child: never by this process), ``W`` the initializers'
bytes (those inline and those in the graph's external data file, ``model.onnx.data``:
the check counts every tensor's bytes wherever they lie) and ``tokens`` the rows of
the largest session run (:func:`onnx_step_tokens`: ``n_batch``, doubled where the
worker pads two or more slots into one call)::

    weights   1.4 · W: the initializers and most kernels' prepacked copies (the worker
              loads the graph from its verified descriptor's path, so no copy of the
              file's bytes stays, and hands the load's freed heap back); + 1.3 · the
              float16 initializers' bytes for a float16 graph (float16 key/value
              cache): the CPU kernels widen them to float32
    kv        kv_bytes_per_token · n_ctx · parallel: each slot's key/value cells, numpy
              arrays grown as the slot fills, up to n_ctx
    compute   2 · kv (a step's past fed in and the presents it returns) + the arena:
              ONNX_ARENA_SLACK · the largest of three phases of a run of ``tokens`` rows:
                output     4 · rows · n_vocab (+ 2 · n_embd · n_vocab, MatMulNBits's
                           workspace for the head); rows = tokens, or for a graph that
                           takes logits_to_keep min(n_batch, n_ctx): a drift replay's
                           every row, one slot
                attention  3.5 · 4 · tokens · n_head · n_ctx (scores, mask, softmax)
                mlp        3 · 4 · tokens · n_ff
    overhead  ONNX_SESSION_BYTES (the session's graph and kernels, the vocabulary)
    runtime   ONNX_WORKER_RUNTIME_BYTES (where the caller counts it)

The constants were measured (``docs/memory-model.md``: real workers on the
demo's folders and the realistic model's, every slot filled, the worker's peak
RSS, ``VmHWM``; every estimate within 16 % of it, and of the server's measurement,
the RSS at ready plus the growth below). The worker
allocates its KV cells and step buffers as its slots fill, so what it holds
when it becomes ready lacks them: :func:`onnx_growth_bytes` is what the
server adds to that measurement (``telemetry.occupancy``).
"""

from __future__ import annotations

from pathlib import Path

from quantroute.errors import ArtifactIntegrityError, ConfigError
from quantroute.registry.onnx_check import DataFile, OnnxSummary
from quantroute.registry.onnx_pair import read_onnx_isolated
from quantroute.telemetry.memory import WORKER_RUNTIME_BYTES, Footprint

__all__ = [
    "ONNX_ARENA_SLACK",
    "ONNX_ATTENTION_COPIES",
    "ONNX_FLOAT16_COPIES",
    "ONNX_SESSION_BYTES",
    "ONNX_WEIGHT_COPIES",
    "ONNX_WORKER_RUNTIME_BYTES",
    "estimate_onnx_footprint",
    "is_onnx",
    "onnx_compute_bytes",
    "onnx_growth_bytes",
    "onnx_kv_bytes",
    "onnx_step_tokens",
    "read_onnx_shape",
]

MiB = 1 << 20

# Measured (docs/memory-model.md), onnxruntime 1.32 on x86-64, 1 thread.
ONNX_WEIGHT_COPIES = 1.4  # resident bytes per byte of initializers (the initializers, most
# kernels' prepacked copies; the worker loads from the file's path and trims the load's heap)
ONNX_FLOAT16_COPIES = 1.3  # more per byte of float16 initializers: widened to float32
ONNX_SESSION_BYTES = 12 * MiB  # a session beyond its weights, and the tokenizer's vocabulary
ONNX_ATTENTION_COPIES = 3.5  # score-sized buffers live at once in the attention phase
ONNX_ARENA_SLACK = 1.1  # the CPU arena grows by whole regions and keeps them
# What the worker process holds before it loads a graph: the llama.cpp worker's runtime
# (the interpreter, numpy, llama_cpp, msgspec, its modules) and onnxruntime (21 MiB
# imported) with its thread pool.
ONNX_WORKER_RUNTIME_BYTES = WORKER_RUNTIME_BYTES + 24 * MiB


def is_onnx(path: Path) -> bool:
    """A branch's file is an ONNX graph: the registry admits a tokenizer only beside a
    ``.onnx`` file (``registry.branch``), and checks it as one."""
    return path.suffix == ".onnx"


def read_onnx_shape(path: Path, data: DataFile | None = None) -> OnnxSummary:
    """The graph's interface and its tokenizer's metadata, as the repository scan's
    bounded check found them (or a new check of the graph alone, in a bounded child,
    its external tensors against ``data``: ``BranchArtifact.data_file()``; without it,
    ``<graph>.data`` beside the graph where there is one, which only sizes the estimate:
    the worker loads the verified file). Raises :class:`ConfigError` for a graph the
    check refuses. Blocking."""
    if data is None:
        beside = path.with_name(path.name + ".data")
        try:
            data = DataFile(beside.name, beside.stat().st_size) if beside.is_file() else None
        except OSError:
            data = None
    try:
        return read_onnx_isolated(path, data=data)
    except ArtifactIntegrityError as exc:
        raise ConfigError(f"cannot read ONNX graph {path.name}: {exc.message}") from None


def onnx_kv_bytes(shape: OnnxSummary, n_ctx: int, n_parallel: int = 1) -> int:
    """``kv_bytes_per_token · n_ctx · n_parallel``: every layer's keys and values, in the
    graph's cache type (``n_layer · 2 · n_kv_heads · head_dim · bytes`` a token)."""
    return shape.kv_bytes_per_token * n_ctx * n_parallel


def onnx_compute_bytes(shape: OnnxSummary, n_ctx: int, n_parallel: int, n_batch: int) -> int:
    """The largest step's buffers beyond the KV cells (see the module docstring)."""
    tokens = onnx_step_tokens(n_ctx, n_parallel, n_batch)
    # rows of logits: a graph that takes logits_to_keep computes a prompt's last row alone,
    # and every row only for a drift replay's teacher-forced sequence (one slot's batch)
    rows = min(n_batch, n_ctx) if shape.keeps_rows else tokens
    n_head = shape.n_head or shape.n_kv_heads
    n_embd = shape.n_embd or n_head * shape.head_dim
    n_ff = shape.n_ff or 4 * n_embd
    output = 4 * rows * shape.n_vocab
    if shape.quantized_matmuls:  # MatMulNBits's workspace for the head
        output += 2 * n_embd * shape.n_vocab
    attention = ONNX_ATTENTION_COPIES * 4 * tokens * n_head * n_ctx
    mlp = 3 * 4 * tokens * n_ff
    arena = ONNX_ARENA_SLACK * max(output, attention, mlp)
    return 2 * onnx_kv_bytes(shape, n_ctx, n_parallel) + round(arena)


def onnx_step_tokens(n_ctx: int, n_parallel: int, n_batch: int) -> int:
    """The rows of the largest session run: a step's ``n_batch`` tokens, which the worker
    runs as one padded call of its slots while padding at most doubles them
    (``worker_model._calls``), and never more than the slots' cells."""
    return min(n_batch * min(2, n_parallel), n_ctx * n_parallel)


def estimate_onnx_footprint(
    shape: OnnxSummary,
    n_ctx: int,
    *,
    n_parallel: int = 1,
    n_batch: int = 512,
    runtime_bytes: int = 0,
) -> Footprint:
    """Estimate an ONNX Runtime branch's footprint before loading it (the module
    docstring); ``n_ctx`` is per slot (0: the tokenizer's training context). Pass
    ``runtime_bytes=ONNX_WORKER_RUNTIME_BYTES`` to compare with the worker's whole RSS.
    Raises :class:`ConfigError` when no context length is known."""
    n_ctx = n_ctx or shape.n_ctx_train
    if n_ctx < 1:
        raise ConfigError(
            "the ONNX branch's context length is unknown (its tokenizer gives none): "
            "set engine.n_ctx or the branch's options.n_ctx"
        )
    if n_parallel < 1:
        raise ValueError("n_parallel must be >= 1")
    return Footprint(
        weights_bytes=round(ONNX_WEIGHT_COPIES * shape.weights_bytes)
        + (round(ONNX_FLOAT16_COPIES * shape.float16_bytes) if shape.kv_element_bytes == 2 else 0),
        kv_bytes=onnx_kv_bytes(shape, n_ctx, n_parallel),
        compute_bytes=onnx_compute_bytes(shape, n_ctx, n_parallel, n_batch),
        overhead_bytes=ONNX_SESSION_BYTES,
        runtime_bytes=runtime_bytes,
    )


def onnx_growth_bytes(footprint: Footprint) -> int:
    """What an ONNX worker allocates after it is ready (its KV cells and step buffers grow
    as its slots fill): added to the RSS measured then."""
    return footprint.kv_bytes + footprint.compute_bytes

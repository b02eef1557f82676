"""Shared value types: precisions and the small records every package speaks.

Precisions are a closed enum with a spec; a precision is always declared (in a
manifest or by the builder), never inferred from a file name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, get_args


@dataclass(frozen=True, slots=True)
class PrecisionSpec:
    """What a precision costs and needs.

    ``bits_per_weight`` is the format's storage cost (block scales and zero points
    included): llama.cpp's figure for a GGUF type; for ``int8`` and ``int4``, ONNX
    Runtime's ``MatMulNBits`` in blocks of 32 with a float32 scale and a zero point
    each (8 + 1 + 1/4 and 4 + 1 + 1/8). ``rank`` orders precisions from most faithful
    (0) to least, and breaks ties when no measured profile exists. ``gguf``: a GGUF
    file can hold it (llama.cpp's); ``int8``/``int4`` are ONNX Runtime's
    (``engines/onnx``), ``fp8``/``awq`` a remote server's.
    """

    bits_per_weight: float
    rank: int
    needs_gpu: bool = False
    gguf: bool = True


class Precision(StrEnum):
    """Every precision quantroute knows. Closed: add one here, with its spec."""

    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    FP8 = "fp8"
    Q8_0 = "q8_0"
    INT8 = "int8"
    Q6_K = "q6_k"
    Q5_K_M = "q5_k_m"
    AWQ = "awq"
    Q4_K_M = "q4_k_m"
    INT4 = "int4"
    Q4_0 = "q4_0"
    Q3_K_M = "q3_k_m"
    Q2_K = "q2_k"

    @property
    def spec(self) -> PrecisionSpec:
        return _SPECS[self]


_SPECS: dict[Precision, PrecisionSpec] = {
    Precision.F32: PrecisionSpec(32.0, 0),
    Precision.BF16: PrecisionSpec(16.0, 1),
    Precision.F16: PrecisionSpec(16.0, 1),
    Precision.FP8: PrecisionSpec(8.0, 2, needs_gpu=True, gguf=False),
    Precision.Q8_0: PrecisionSpec(8.5, 3),
    # ONNX Runtime's asymmetric blocks of 32 (f32 scale, 8-bit zero point): on the demo,
    # a lower KLD than q8_0; int4 (4-bit zero points) in q4_k_m's league
    Precision.INT8: PrecisionSpec(9.25, 3, gguf=False),
    Precision.Q6_K: PrecisionSpec(6.5625, 4),
    Precision.Q5_K_M: PrecisionSpec(5.69, 5),
    Precision.AWQ: PrecisionSpec(4.25, 6, needs_gpu=True, gguf=False),
    Precision.Q4_K_M: PrecisionSpec(4.89, 6),
    Precision.INT4: PrecisionSpec(5.125, 6, gguf=False),
    Precision.Q4_0: PrecisionSpec(4.5, 7),
    Precision.Q3_K_M: PrecisionSpec(3.91, 8),
    Precision.Q2_K: PrecisionSpec(2.96, 9),
}


def versioned_name(model: str, version: str | None) -> str:
    """``model@version``, the route a model's version is served as (``model`` with none)."""
    return model if version is None else f"{model}@{version}"


def split_version(name: str) -> tuple[str, str | None]:
    """``model@version`` to ``(model, version)``; a name without a version to ``(name, None)``."""
    model, _, version = name.partition("@")
    return model, version or None


@dataclass(frozen=True, slots=True)
class BranchId:
    """``model:branch``, the name a client may pin (``tiny-llama:q4_k_m``)."""

    model: str
    branch: str

    def __str__(self) -> str:
        return f"{self.model}:{self.branch}"


@dataclass(frozen=True, slots=True)
class Offload:
    """Where an engine runs its model: ``gpu`` is the CUDA device index in NVML's order
    (``None``: the CPU), ``n_gpu_layers`` how many layers go there (-1: all).
    ``oom_flag`` is set on a simulated device: a file that exists while the device is
    over its budget, so the worker's own allocations fail as a real device's would.
    ``draft_dropped``: why a reference that speculates starts without its draft
    (placement found no room for it beside the model); ``None``: it may load it."""

    gpu: int | None = None
    n_gpu_layers: int = 0
    oom_flag: str = ""
    draft_dropped: str | None = None


# The ways a llama.cpp worker can be told to fail (``engine.faults``, the worker's
# ``--fault``; each is described in engines/llamacpp/worker.py's docstring): test hooks.
WorkerFault = Literal[
    "sigill-at-first-decode",
    "exit-at-load",
    "oversize-line",
    "oom-at-decode",
    "hang-up-at-decode",
    "hang-at-decode",
]
WORKER_FAULTS: tuple[WorkerFault, ...] = get_args(WorkerFault)

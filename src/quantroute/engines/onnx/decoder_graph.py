"""The llama decoder as an ONNX graph, written with ``onnx.helper`` from GGUF-named weights.

It computes what llama.cpp's ``llama`` graph computes: RMSNorm, RoPE, grouped-
query attention over a key/value cache, a SwiGLU feed-forward, an output head
(``output.weight``, or the token embedding when the model ties them). Inputs and
outputs are those of :mod:`quantroute.engines.onnx.layout`. Only standard ONNX
operators, plus ONNX Runtime's ``com.microsoft.MatMulNBits`` for ``int8`` and ``int4``.

RoPE: llama.cpp's ``llama`` rope (GGML mode 0) rotates adjacent pairs of a head,
Hugging Face's the two halves. :func:`halves_from_pairs` reorders the rows of
``attn_q`` and ``attn_k`` within each head (evens, then odds: the inverse of
what llama.cpp's converter does to a Hugging Face checkpoint), so rotating
halves here is the same arithmetic on the same numbers, and the attention
scores are llama.cpp's; only the order of the cached keys' features differs.

The export needs ``onnx`` (and ``onnxruntime`` for ``int8``/``int4``); a worker
never imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from quantroute.engines.onnx.layout import (
    LOGITS_TO_KEEP,
    DecoderConfig,
    onnx_precision,
    past_names,
    present_names,
)
from quantroute.types import Precision

F32Array = npt.NDArray[np.float32]

NBITS_BLOCK = 32
# The output head keeps 8 bits in int4, as llama.cpp's Q4_K_M keeps it at Q6_K and ONNX
# Runtime's "k_quant_mixed" at 8: on stdlib-bpe-llama a 4-bit head is nine tenths of
# int4's KLD (2.5e-3 against 2.7e-4 with an 8-bit one, top-1 0.90 against 0.98).
HEAD_BITS = 8
# CPU: int8 activations in blocks (as ggml's Q8_0/Q4_K dot products); levels 0/1 (float32)
# decode 10x slower with AVX2 (64 against 6 ms/token on stdlib-bpe-llama, 1 thread). GPUs
# ignore it.
NBITS_ACCURACY_LEVEL = 4
_NBITS = {Precision.INT8: 8, Precision.INT4: 4}
_MASKED = float(np.finfo(np.float32).min)  # finite: a row of padding stays a number, never NaN


def halves_from_pairs(w: F32Array, n_heads: int) -> F32Array:
    """Rows of a ``[n_heads * head_dim, in]`` q/k matrix reordered from pair to half rotation.

    Row ``2i + a`` of a head moves to ``a * head_dim/2 + i``.
    """
    out, d_in = w.shape
    half = out // n_heads // 2
    reordered: F32Array = w.reshape(n_heads, half, 2, d_in).swapaxes(1, 2).reshape(out, d_in)
    return reordered


class DecoderGraph:
    """Collects the nodes and initializers of one decoder; :meth:`build` returns them.

    ``config.precision`` decides each matrix product: float32 ``MatMul``
    (``f32``), float16 ``MatMul`` between two casts (``f16``), or
    ``MatMulNBits`` with 8- or 4-bit weights (``int8``, ``int4``; the output
    head is 8-bit in both).
    """

    def __init__(self, weights: Mapping[str, F32Array], config: DecoderConfig) -> None:
        onnx_precision(config.precision)  # raises for a precision no graph has
        self.w = weights
        self.c = config
        self.precision = config.precision
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0
        self._half_inputs: dict[str, str] = {}  # an activation -> its float16 cast

    # ---- plumbing ----

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"/{hint}_{self._count}"

    def const(self, array: npt.ArrayLike, name: str) -> str:
        """An initializer named ``name`` (kept exactly: weights keep their GGUF names)."""
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", out: str = "", **attrs: Any) -> str:
        """Add one node; returns its (single) output's name (``out``, or a fresh one)."""
        from onnx import helper

        out = out or self._name(op_type)
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [out], name=out, domain=domain, **attrs)
        )
        return out

    def ints(self, *values: int) -> str:
        """An int64 constant (axes, shapes, indices)."""
        return self.const(np.array(values, dtype=np.int64), self._name("ints"))

    def scalar(self, value: float) -> str:
        return self.const(np.array(value, dtype=np.float32), self._name("scalar"))

    def cast(self, x: str, to: Any) -> str:
        return self.op("Cast", x, to=int(to))

    # ---- layers ----

    def linear(self, x: str, name: str, w: F32Array | None = None) -> str:
        """``x @ W.T`` for the GGUF matrix ``name`` (``[out, in]``), in this precision."""
        from onnx import TensorProto

        weight = np.ascontiguousarray((self.w[name] if w is None else w).T)  # [in, out]
        if self.precision is Precision.F16:
            if x not in self._half_inputs:  # q, k, v (gate, up) share one cast of their input
                self._half_inputs[x] = self.cast(x, TensorProto.FLOAT16)
            y = self.op("MatMul", self._half_inputs[x], self.const(weight.astype(np.float16), name))
            return self.cast(y, TensorProto.FLOAT)
        if self.precision in _NBITS:
            bits = HEAD_BITS if name == "output.weight" else _NBITS[self.precision]
            return self._matmul_nbits(x, name, weight, bits)
        return self.op("MatMul", x, self.const(weight, name))

    def _matmul_nbits(self, x: str, name: str, weight: F32Array, bits: int) -> str:
        """``MatMulNBits`` as ONNX Runtime's ``MatMulNBitsQuantizer`` writes it
        (QOperator, asymmetric, blocks of :data:`NBITS_BLOCK` along ``in``)."""
        from onnxruntime.capi import _pybind_state as ort_c  # type: ignore[import-untyped]

        quantize = ort_c.quantize_matmul_8bits if bits == 8 else ort_c.quantize_matmul_4bits
        k, n = weight.shape  # [in, out]
        blocks, per_byte = -(-k // NBITS_BLOCK), 8 // bits
        padded = np.pad(weight, ((0, blocks * NBITS_BLOCK - k), (0, 0)))
        packed = np.zeros((n, blocks, NBITS_BLOCK // per_byte), dtype=np.uint8)
        zero_points = np.zeros((n, -(-blocks // per_byte)), dtype=np.uint8)
        scales = np.zeros((n, blocks), dtype=np.float32)
        quantize(packed, padded, scales, zero_points, NBITS_BLOCK, n, k, False)
        return self.op(
            "MatMulNBits",
            x,
            self.const(packed, f"{name}_Q{bits}"),
            self.const(scales, name + "_scales"),
            self.const(zero_points, name + "_zero_points"),
            domain="com.microsoft",
            K=k,
            N=n,
            bits=bits,
            block_size=NBITS_BLOCK,
            accuracy_level=NBITS_ACCURACY_LEVEL,
        )

    def rms_norm(self, x: str, name: str) -> str:
        """``x / sqrt(mean(x²) + eps) * w`` over the last axis, in float32."""
        ms = self.op("ReduceMean", self.op("Mul", x, x), self.ints(-1), keepdims=1)  # [B, T, 1]
        inv = self.op(
            "Reciprocal", self.op("Sqrt", self.op("Add", ms, self.scalar(self.c.norm_eps)))
        )
        return self.op("Mul", self.op("Mul", x, inv), self.const(self.w[name], name))

    def rope(self, x: str, cos: str, sin: str) -> str:
        """Rotate the halves of ``x`` ``[B, H, T, hd]`` by ``cos``/``sin`` ``[B, 1, T, hd/2]``."""
        from onnx import helper

        half = self.c.head_dim // 2
        x1, x2 = self._name("rope_x1"), self._name("rope_x2")
        self.nodes.append(
            helper.make_node("Split", [x, self.ints(half, half)], [x1, x2], axis=-1, name=x1)
        )
        first = self.op("Sub", self.op("Mul", x1, cos), self.op("Mul", x2, sin))
        second = self.op("Add", self.op("Mul", x2, cos), self.op("Mul", x1, sin))
        return self.op("Concat", first, second, axis=-1)

    def attention(self, i: int, a: str, cos: str, sin: str, keep: str) -> str:
        """Layer ``i``'s attention of the normed input ``a`` ``[B, T, D]``; adds its presents."""
        from onnx import TensorProto

        c, p = self.c, f"blk.{i}."
        h, hkv, hd = c.n_head, c.n_kv_heads, c.head_dim
        wq = halves_from_pairs(self.w[p + "attn_q.weight"], h)
        wk = halves_from_pairs(self.w[p + "attn_k.weight"], hkv)

        def heads(y: str, n: int) -> str:  # [B, T, n*hd] -> [B, n, T, hd]
            return self.op(
                "Transpose", self.op("Reshape", y, self.ints(0, 0, n, hd)), perm=[0, 2, 1, 3]
            )

        q = self.rope(heads(self.linear(a, p + "attn_q.weight", wq), h), cos, sin)
        k = self.rope(heads(self.linear(a, p + "attn_k.weight", wk), hkv), cos, sin)
        v = heads(self.linear(a, p + "attn_v.weight"), hkv)
        half = c.precision is Precision.F16
        present: list[str] = []
        for past, new, out in zip(past_names(i), (k, v), present_names(i), strict=True):
            new = self.cast(new, TensorProto.FLOAT16) if half else new
            concat = self.op("Concat", past, new, axis=2, out=out)  # [B, Hkv, P+T, hd]
            present.append(self.cast(concat, TensorProto.FLOAT) if half else concat)
        # query head j*g + r reads kv head j, as llama.cpp broadcasts: [B, Hkv, g, T, hd]
        q5 = self.op("Reshape", q, self.ints(0, hkv, h // hkv, -1, hd))
        k5 = self.op("Unsqueeze", present[0], self.ints(2))  # [B, Hkv, 1, S, hd]
        v5 = self.op("Unsqueeze", present[1], self.ints(2))
        scores = self.op("MatMul", q5, self.op("Transpose", k5, perm=[0, 1, 2, 4, 3]))
        scores = self.op("Mul", scores, self.scalar(1.0 / float(np.sqrt(hd))))  # [B, Hkv, g, T, S]
        probs = self.op("Softmax", self.op("Where", keep, scores, self.scalar(_MASKED)), axis=-1)
        ctx = self.op("Reshape", self.op("MatMul", probs, v5), self.ints(0, h, -1, hd))
        ctx = self.op("Reshape", self.op("Transpose", ctx, perm=[0, 2, 1, 3]), self.ints(0, 0, -1))
        return self.linear(ctx, p + "attn_output.weight")  # [B, T, D]

    def feed_forward(self, i: int, m: str) -> str:
        p = f"blk.{i}."
        gate = self.linear(m, p + "ffn_gate.weight")  # [B, T, F]
        up = self.linear(m, p + "ffn_up.weight")
        act = self.op("Mul", self.op("Mul", gate, self.op("Sigmoid", gate)), up)
        return self.linear(act, p + "ffn_down.weight")

    def _rope_tables(self) -> tuple[str, str]:
        """cos, sin ``[B, 1, T, hd/2]`` of ``position_ids`` (GGML's "normal" frequencies)."""
        from onnx import TensorProto

        half = self.c.head_dim // 2
        inv_freq = self.c.rope_base ** (-np.arange(half, dtype=np.float64) * 2 / self.c.head_dim)
        pos = self.op("Unsqueeze", self.cast("position_ids", TensorProto.FLOAT), self.ints(1, 3))
        angles = self.op("Mul", pos, self.const(inv_freq.astype(np.float32), "rope_inv_freq"))
        return self.op("Cos", angles), self.op("Sin", angles)

    def _keep_mask(self) -> str:
        """Which keys each query sees ``[B, 1, 1, T, S]``: a token (mask 1) not after it."""
        from onnx import TensorProto

        t = self.op("Gather", self.op("Shape", "input_ids"), self.ints(1), axis=0)  # [1]
        s = self.op("Gather", self.op("Shape", "attention_mask"), self.ints(1), axis=0)
        t, s = self.op("Squeeze", t), self.op("Squeeze", s)
        one = self.const(np.array(1, dtype=np.int64), "one")
        keys = self.op("Range", self.const(np.array(0, dtype=np.int64), "zero"), s, one)  # [S]
        queries = self.op("Range", self.op("Sub", s, t), s, one)  # [T]: their cache indices
        causal = self.op(
            "LessOrEqual",
            self.op("Unsqueeze", keys, self.ints(0)),
            self.op("Unsqueeze", queries, self.ints(1)),
        )  # [T, S]
        tokens = self.op(
            "Unsqueeze", self.cast("attention_mask", TensorProto.BOOL), self.ints(1, 2, 3)
        )  # [B, 1, 1, 1, S]
        return self.op("And", tokens, causal)

    def build(self) -> tuple[list[Any], list[Any]]:
        """Every node and initializer of the decoder."""
        from onnx import TensorProto

        c = self.c
        embd = self.w["token_embd.weight"]
        table = embd if self.precision is Precision.F32 else embd.astype(np.float16)
        x = self.op("Gather", self.const(table, "token_embd.weight"), "input_ids", axis=0)
        if table.dtype != np.float32:
            x = self.cast(x, TensorProto.FLOAT)  # [B, T, D]
        cos, sin = self._rope_tables()
        keep = self._keep_mask()
        for i in range(c.n_layer):
            a = self.rms_norm(x, f"blk.{i}.attn_norm.weight")
            x = self.op("Add", x, self.attention(i, a, cos, sin, keep))
            m = self.rms_norm(x, f"blk.{i}.ffn_norm.weight")
            x = self.op("Add", x, self.feed_forward(i, m))
        x = self.rms_norm(self._last_rows(x), "output_norm.weight")  # [B, K, D]
        head = "output.weight" if "output.weight" in self.w else "token_embd.weight"
        logits = self.linear(x, "output.weight", self.w[head])  # [B, K, V]
        self.op("Identity", logits, out="logits")
        return self.nodes, self.initializers

    def _last_rows(self, x: str) -> str:
        """The last ``logits_to_keep`` rows of ``x`` ``[B, T, D]``; every row for 0 (its
        default: the input is an initializer a caller may override)."""
        self.const(np.array(0, dtype=np.int64), LOGITS_TO_KEEP)
        start = self.op("Reshape", self.op("Neg", LOGITS_TO_KEEP), self.ints(1))  # [1]
        return self.op("Slice", x, start, self.ints(np.iinfo(np.int64).max), self.ints(1))


def build_decoder(weights: Mapping[str, F32Array], config: DecoderConfig) -> Any:
    """The decoder as an ``onnx.ModelProto``, at ``config.precision``.

    ``weights`` are GGUF-named float32 arrays in torch's ``[out, in]`` layout, as
    :func:`quantroute.demo.gguf_export.read_llama_gguf` returns them.
    """
    from onnx import TensorProto, helper

    nodes, initializers = DecoderGraph(weights, config).build()
    kv = TensorProto.FLOAT16 if config.precision is Precision.F16 else TensorProto.FLOAT
    b, t, p, s = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    kv_in: list[str | int] = [b, config.n_kv_heads, p, config.head_dim]
    kv_out: list[str | int] = [b, config.n_kv_heads, s, config.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b, t]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [b, s]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [b, t]),
    ]
    logits: list[str | int] = [b, "logits_length", config.n_vocab]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, logits)]
    for i in range(config.n_layer):
        inputs += [helper.make_tensor_value_info(n, kv, kv_in) for n in past_names(i)]
        outputs += [helper.make_tensor_value_info(n, kv, kv_out) for n in present_names(i)]
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, []))
    body = helper.make_graph(nodes, "decoder", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 21)]
    if config.precision in _NBITS:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(body, opset_imports=opsets, producer_name="quantroute")
    model.ir_version = 10  # what ONNX Runtime 1.20+ reads (onnx's newest would shut out older ones)
    return model

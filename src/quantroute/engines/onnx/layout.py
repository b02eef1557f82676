"""An ONNX decoder folder: what the export writes and an ONNX Runtime worker reads.

::

    <branch>/model.onnx       the decoder graph, weights inline (or beside it in
                              model.onnx.data past 1.5 GiB)
    <branch>/config.json      Hugging Face's Llama config.json keys, plus a "quantroute" block
    <branch>/tokenizer.gguf   the source GGUF's metadata without tensors: llama.cpp loads
                              it with ``vocab_only`` and tokenizes exactly as on the GGUF

The graph speaks the key/value-cache interface of Hugging Face Optimum's and
onnxruntime-genai's decoder exports, so a worker written for these folders also
runs such a model (given a tokenizer)::

    input_ids                 int64  [B, T]
    attention_mask            int64  [B, P+T]   1 = a token, 0 = padding (left)
    position_ids              int64  [B, T]     RoPE positions; pads are masked anyway
    past_key_values.{i}.key   kv     [B, n_kv_heads, P, head_dim]   (and .value)
    logits_to_keep            int64  []         optional: K, the last rows of logits
                                                wanted; 0 (its default) for all T
    logits                    float32 [B, K, V]
    present.{i}.key           kv     [B, n_kv_heads, P+T, head_dim] (and .value)

``kv`` is float16 for an ``f16`` folder, float32 otherwise. A first step passes
pasts of length 0. ``logits_to_keep`` (Hugging Face's name for the same argument)
is an initializer as well as an input, so a caller that does not feed it gets
every row; a prefill that wants the last row only saves the output head's work on
the others (45 % of a 512-token prefill of stdlib-bpe-llama at f32, 64 % at int4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quantroute.types import Precision

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.gguf"
LOGITS_TO_KEEP = "logits_to_keep"
FORMAT_VERSION = 1


ONNX_PRECISIONS: frozenset[Precision] = frozenset(
    {Precision.F32, Precision.F16, Precision.INT8, Precision.INT4}
)
"""What an exported folder's weights can be.

``f32`` and ``f16``: every matrix in that float type. ``int8`` and ``int4``: the
matrices as ``MatMulNBits`` weights of 8 or 4 bits in blocks of 32 along the
input, each block with a float32 scale and a zero point; the output head is
8-bit in both (as Q4_K_M keeps it at Q6_K); on a CPU the activations are
rounded to int8 per row in blocks of 32 (``accuracy_level`` 4). The token
embedding is float16 in all but ``f32``.
"""


_SPELLINGS = {"fp32": Precision.F32, "fp16": Precision.F16}  # ONNX tooling's names


def onnx_precision(value: Precision | str) -> Precision:
    """``value`` as one of :data:`ONNX_PRECISIONS`: ``"int4"``, ``Precision.F16``, or
    ``"fp16"``/``"fp32"`` as Optimum and onnxruntime-genai spell them; ``ValueError``
    for anything else."""
    precision = Precision(_SPELLINGS.get(value, value))
    if precision not in ONNX_PRECISIONS:
        raise ValueError(f"no ONNX export at {value}; choose from f32, f16, int8, int4")
    return precision


def kv_dtype(precision: Precision) -> np.dtype[Any]:
    """The dtype of the past/present key-value tensors of a folder at ``precision``."""
    return np.dtype(np.float16 if precision is Precision.F16 else np.float32)


def past_names(layer: int) -> tuple[str, str]:
    """The key and value inputs of ``layer``."""
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    """The key and value outputs of ``layer``."""
    return f"present.{layer}.key", f"present.{layer}.value"


def input_names(n_layer: int) -> list[str]:
    """Every graph input, in order."""
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(n_layer):
        names.extend(past_names(i))
    return names


def output_names(n_layer: int) -> list[str]:
    """Every graph output, in order."""
    names = ["logits"]
    for i in range(n_layer):
        names.extend(present_names(i))
    return names


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """The shape and tokens of an exported decoder: ``config.json``.

    Written with Hugging Face's key names (``num_hidden_layers``,
    ``num_key_value_heads``, ...) so a worker reads the config.json of an
    Optimum export the same way; what Hugging Face has no key for sits under
    ``"quantroute"``.
    """

    n_layer: int
    n_head: int
    n_kv_heads: int
    head_dim: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    norm_eps: float
    bos_id: int
    eos_id: int
    add_bos: bool
    tied_embeddings: bool
    precision: Precision  # one of ONNX_PRECISIONS
    source_sha256: str  # the GGUF the weights and tokenizer came from

    @property
    def kv_dtype(self) -> np.dtype[Any]:
        """The dtype of the past/present key-value tensors."""
        return kv_dtype(self.precision)

    def to_json(self) -> dict[str, Any]:
        """The config.json object."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.n_embd,
            "intermediate_size": self.n_ff,
            "vocab_size": self.n_vocab,
            "max_position_embeddings": self.n_ctx_train,
            "rope_theta": self.rope_base,
            "rms_norm_eps": self.norm_eps,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "tie_word_embeddings": self.tied_embeddings,
            "quantroute": {
                "format": FORMAT_VERSION,
                "precision": self.precision.value,
                "kv_dtype": self.kv_dtype.name,
                "add_bos": self.add_bos,
                "model": MODEL_FILE,
                "tokenizer": TOKENIZER_FILE,
                "source_sha256": self.source_sha256,
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DecoderConfig:
        """Read what :meth:`to_json` wrote. Raises ``KeyError``/``ValueError`` otherwise."""
        ours = data["quantroute"]
        if ours["format"] != FORMAT_VERSION:
            raise ValueError(f"config.json format {ours['format']}, expected {FORMAT_VERSION}")
        return cls(
            n_layer=int(data["num_hidden_layers"]),
            n_head=int(data["num_attention_heads"]),
            n_kv_heads=int(data["num_key_value_heads"]),
            head_dim=int(data["head_dim"]),
            n_embd=int(data["hidden_size"]),
            n_ff=int(data["intermediate_size"]),
            n_vocab=int(data["vocab_size"]),
            n_ctx_train=int(data["max_position_embeddings"]),
            rope_base=float(data["rope_theta"]),
            norm_eps=float(data["rms_norm_eps"]),
            bos_id=int(data["bos_token_id"]),
            eos_id=int(data["eos_token_id"]),
            add_bos=bool(ours["add_bos"]),
            tied_embeddings=bool(data["tie_word_embeddings"]),
            precision=Precision(ours["precision"]),
            source_sha256=str(ours["source_sha256"]),
        )

    def write(self, folder: Path) -> None:
        """Write ``folder/config.json`` (sorted keys, so the same config is the same bytes)."""
        text = json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"
        (folder / CONFIG_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> DecoderConfig:
        """Read ``folder/config.json``."""
        return cls.from_json(json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")))

    def empty_past(self, batch: int) -> dict[str, np.ndarray[Any, Any]]:
        """Zero-length pasts for a first step: ``[batch, n_kv_heads, 0, head_dim]`` each."""
        shape = (batch, self.n_kv_heads, 0, self.head_dim)
        past: dict[str, np.ndarray[Any, Any]] = {}
        for i in range(self.n_layer):
            for name in past_names(i):
                past[name] = np.zeros(shape, dtype=self.kv_dtype)
        return past

"""Writing, quantizing and rewriting GGUF files.

- :func:`write_llama_gguf` writes trained weights as an ``llama``-architecture
  GGUF with ``gguf``'s ``GGUFWriter`` (F32, or F16 for matrices).
- :func:`quantize_gguf` makes F16 / Q8_0 / Q4_K_M / Q4_0 files with llama.cpp's
  own quantizer, from an F32 file.
- :func:`copy_gguf_with_metadata` and :func:`perturb_gguf_weights` rewrite an
  existing GGUF: new string metadata (say a hostile ``tokenizer.chat_template``),
  or noisy float weights (to make a drifted model). Tests use both.

Rewrites go to a temporary file next to ``dst`` and are renamed into place, so
a reader never sees half a file and ``dst`` may be ``src``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from quantroute.demo.model import ModelConfig
from quantroute.demo.vocab import VOCAB
from quantroute.types import Precision

logger = logging.getLogger(__name__)

ARCH = "llama"
MetadataValue = str | int | float | bool


class GgufVocab(Protocol):
    """A vocabulary that can describe itself to llama.cpp.

    ``size`` is the number of tokens (the model's ``n_vocab``);
    ``add_to_gguf(writer)`` adds every ``tokenizer.*`` key (and the vocab
    size) to a ``gguf.GGUFWriter``. :class:`~quantroute.demo.vocab.ByteVocab`
    (SPM, ``llama``) and :class:`~quantroute.demo.bpe.BpeVocab` (BPE,
    ``gpt2``) implement it.
    """

    @property
    def size(self) -> int: ...

    def add_to_gguf(self, writer: Any) -> None: ...


_FILE_MODE = 0o644  # model files are data anyone may read; mkstemp would leave 0600

# llama.cpp's llama_ftype values for the precisions its quantizer makes.
_FTYPES: dict[Precision, int] = {
    Precision.F16: 1,  # LLAMA_FTYPE_MOSTLY_F16
    Precision.Q8_0: 7,  # LLAMA_FTYPE_MOSTLY_Q8_0
    Precision.Q4_0: 2,  # LLAMA_FTYPE_MOSTLY_Q4_0
    Precision.Q4_K_M: 15,  # LLAMA_FTYPE_MOSTLY_Q4_K_M
}
QUANTIZABLE: frozenset[Precision] = frozenset(_FTYPES)
"""Precisions :func:`quantize_gguf` can make."""


def write_llama_gguf(
    path: Path,
    weights: Mapping[str, npt.NDArray[np.float32]],
    config: ModelConfig,
    *,
    vocab: GgufVocab = VOCAB,
    name: str = "tiny-llama",
    description: str = "",
    extra: Mapping[str, MetadataValue] | None = None,
    float_type: Literal["f32", "f16"] = "f32",
) -> None:
    """Write ``weights`` (GGUF names, torch ``[out, in]`` layout) as a llama GGUF.

    ``float_type="f16"`` stores matrices as F16 and keeps the 1-D norm weights
    in F32, as llama.cpp's converter does. ``extra`` adds metadata keys (use a
    ``quantroute.`` prefix); ints are written as int64, floats as float32.
    """
    import gguf

    missing = {"token_embd.weight", "output.weight", "output_norm.weight"} - set(weights)
    if missing:
        raise ValueError(f"weights lack {sorted(missing)}")
    if config.vocab_size != vocab.size:
        raise ValueError(f"model vocab {config.vocab_size} != tokenizer vocab {vocab.size}")

    def build(writer: Any) -> None:
        writer.add_name(name)
        if description:
            writer.add_description(description)
        writer.add_file_type(
            gguf.LlamaFileType.ALL_F32 if float_type == "f32" else gguf.LlamaFileType.MOSTLY_F16
        )
        writer.add_context_length(config.context_length)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_ff)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.kv_heads)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_rope_freq_base(config.rope_base)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        vocab.add_to_gguf(writer)
        for key, value in (extra or {}).items():
            _add_scalar(writer, key, value)
        for tensor_name, array in weights.items():
            data = np.ascontiguousarray(array, dtype=np.float32)
            if float_type == "f16" and data.ndim >= 2:
                data = data.astype(np.float16)
            writer.add_tensor(tensor_name, data)

    _write_atomically(path, ARCH, build)


def _add_scalar(writer: Any, key: str, value: MetadataValue) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def _write_atomically(
    path: Path, arch: str, build: Callable[[Any], None], *, alignment: int | None = None
) -> None:
    """Let ``build`` fill a GGUFWriter, write it to a temp file, rename it to ``path``."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        if alignment is not None:
            writer.data_alignment = alignment
        build(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.chmod(_FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _quiet_llama_log() -> Iterator[None]:
    # llama-cpp-python routes llama.cpp's log through this logger's level;
    # the quantizer's per-tensor chatter would otherwise flood stderr.
    llama_logger = logging.getLogger("llama-cpp-python")
    before = llama_logger.level
    llama_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        llama_logger.setLevel(before)


def quantize_gguf(src: Path, dst: Path, precision: Precision, *, threads: int = 2) -> None:
    """Quantize an F32 GGUF with llama.cpp's ``llama_model_quantize``.

    Uses ``llama_model_quantize_default_params()`` with only ``ftype`` and
    ``nthread`` set. Raises ``ValueError`` for a precision the quantizer does
    not make here, ``RuntimeError`` when llama.cpp reports a failure.
    """
    if precision not in _FTYPES:
        raise ValueError(f"cannot quantize to {precision}; choose from {sorted(QUANTIZABLE)}")
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[precision]
    params.nthread = threads
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with _quiet_llama_log():
            rc = llama_cpp.llama_model_quantize(
                os.fsencode(src), os.fsencode(tmp), ctypes.byref(params)
            )
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src.name} -> {precision}) returned {rc}")
        tmp.chmod(_FILE_MODE)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info(
        "quantized %s -> %s (%s, %d bytes)", src.name, dst.name, precision, dst.stat().st_size
    )


def _open_reader(src: Path) -> Any:
    import gguf

    reader = gguf.GGUFReader(src, "r")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{src}: only little-endian GGUF files can be rewritten")
    return reader


def _rewrite(
    src: Path,
    dst: Path,
    overrides: Mapping[str, str],
    tensor_data: Callable[[Any], npt.NDArray[Any]],
) -> None:
    """Copy ``src`` to ``dst``, with string ``overrides`` and tensors from ``tensor_data``."""
    import gguf

    reader = _open_reader(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = str(arch_field.contents()) if arch_field is not None else ARCH
    align_field = reader.get_field(gguf.Keys.General.ALIGNMENT)
    alignment = int(align_field.contents()) if align_field is not None else None

    def build(writer: Any) -> None:
        for field in reader.fields.values():
            # the writer adds the architecture itself; GGUF.* are header pseudo-fields
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            if field.name in overrides:
                continue
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
        for key, value in overrides.items():
            writer.add_string(key, value)
        for tensor in reader.tensors:
            data = tensor_data(tensor)
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)

    _write_atomically(dst, arch, build, alignment=alignment)


def copy_gguf_with_metadata(src: Path, dst: Path, extra: dict[str, str]) -> None:
    """Write a copy of ``src`` to ``dst`` with string metadata keys added or replaced.

    Tensors are copied byte for byte, quantized or not. For example, a model
    carrying a chat template::

        copy_gguf_with_metadata(f16, tmp / "chat.gguf",
                                {"tokenizer.chat_template": "{{ messages[0].content }}"})
    """
    if not all(isinstance(v, str) for v in extra.values()):
        raise TypeError("metadata values must be strings")
    _rewrite(src, dst, extra, lambda tensor: tensor.data)
    logger.info("copied %s -> %s with %s", src.name, dst.name, sorted(extra))


def perturb_gguf_weights(src: Path, dst: Path, scale: float, seed: int) -> None:
    """Write a copy of ``src`` whose F32/F16 tensors carry Gaussian noise.

    Each float tensor ``w`` becomes ``w + scale * rms(w) * N(0, 1)``: ``scale``
    is relative, so ``0.01`` is 1 % noise in every tensor alike. Quantized
    tensors are copied unchanged; noise is drawn from ``seed`` in tensor order,
    so the same call writes the same file.
    """
    import gguf

    if scale < 0:
        raise ValueError("scale must be >= 0")
    rng = np.random.default_rng(seed)
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}

    def noisy(tensor: Any) -> npt.NDArray[Any]:
        data: npt.NDArray[Any] = tensor.data
        if tensor.tensor_type not in floats:
            return data
        w = np.asarray(data, dtype=np.float32)
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
        out = w + rng.standard_normal(w.shape, dtype=np.float32) * np.float32(scale * rms)
        return out.astype(data.dtype)

    _rewrite(src, dst, {}, noisy)
    logger.info("perturbed %s -> %s (relative noise %g, seed %d)", src.name, dst.name, scale, seed)


def read_llama_gguf(path: Path) -> tuple[ModelConfig, dict[str, npt.NDArray[np.float32]]]:
    """The shape and float32 weights of an F32/F16 llama GGUF (the inverse of writing).

    Raises ``ValueError`` for quantized tensors, which have no exact float form.
    """
    import gguf

    reader = _open_reader(path)
    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: architecture {arch!r}, expected {ARCH!r}")
    tokens = reader.get_field(gguf.Keys.Tokenizer.LIST)
    n_head = int(meta["llama.attention.head_count"])
    n_head_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    config = ModelConfig(
        vocab_size=len(tokens.contents()) if tokens is not None else VOCAB.size,
        n_embd=int(meta["llama.embedding_length"]),
        n_layer=int(meta["llama.block_count"]),
        n_head=n_head,
        n_head_kv=None if n_head_kv == n_head else n_head_kv,
        n_ff=int(meta["llama.feed_forward_length"]),
        context_length=int(meta["llama.context_length"]),
        rope_base=float(meta.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
    )
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    weights: dict[str, npt.NDArray[np.float32]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in floats:
            raise ValueError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}")
        weights[tensor.name] = np.array(tensor.data, dtype=np.float32)
    return config, weights


def read_metadata(path: Path) -> dict[str, MetadataValue]:
    """The scalar and string metadata of a GGUF file (arrays left out)."""
    import gguf

    reader = gguf.GGUFReader(path, "r")
    out: dict[str, MetadataValue] = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        out[field.name] = value
    return out

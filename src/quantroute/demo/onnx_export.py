"""Export a llama GGUF (F16 or F32) as ONNX decoder folders: f32, f16, int8, int4.

Each folder is the layout of :mod:`quantroute.engines.onnx.layout`: the decoder
graph (:mod:`quantroute.engines.onnx.decoder_graph`, written node by node from
the GGUF's weights: no torch, no tracing, the same bytes for the same GGUF),
its ``config.json``, and ``tokenizer.gguf``, the GGUF's own vocabulary.

- ``f32``: float32 throughout.
- ``f16``: float16 matrices and key/value cache; activations rounded to
  float16 going into each matrix product (as ggml does with F16 weights on CPU);
  norms, RoPE, attention scores and softmax in float32.
- ``int8`` / ``int4``: ``MatMulNBits`` weights in blocks of 32 with a float32
  scale and a zero point each, packed by ONNX Runtime's own kernel (the bytes
  its ``MatMulNBitsQuantizer`` writes); the output head at 8 bits in both (as
  Q4_K_M keeps it at Q6_K); on the CPU, activations go to int8 in blocks of 32
  per row (``accuracy_level`` 4, as ggml's quantized dot products do). Not
  ``quantize_dynamic``: its one activation scale per call puts int8 (KLD 1.6e-2 on
  the demo) behind int4 (1.0e-2), and makes a row's logits depend on its batch.

The token embedding is float16 in every folder but ``f32`` (lossless from an
F16 GGUF); norms stay float32.

>>> export_onnx_branches(repo / "f16.gguf", repo)  # doctest: +SKIP
{'onnx_fp16': PosixPath('.../onnx_fp16'), 'onnx_int8': ..., 'onnx_int4': ...}
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from quantroute.demo.gguf_export import _open_reader, _write_atomically, read_llama_gguf
from quantroute.demo.gguf_export import read_metadata as read_gguf_metadata
from quantroute.demo.model import ModelConfig
from quantroute.engines.onnx.decoder_graph import build_decoder
from quantroute.engines.onnx.layout import (
    MODEL_FILE,
    TOKENIZER_FILE,
    DecoderConfig,
    onnx_precision,
)
from quantroute.registry.branch import BranchSpec, DeclaredFile, TokenizerFile
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    Manifest,
    load_manifest,
    sha256_file,
    write_manifest,
)
from quantroute.types import Precision

logger = logging.getLogger(__name__)

F32Array = npt.NDArray[np.float32]

DEMO_ONNX_BRANCHES: dict[str, Precision] = {
    "onnx_fp16": Precision.F16,
    "onnx_int8": Precision.INT8,
    "onnx_int4": Precision.INT4,
}
"""The ONNX branches ``quantroute demo build`` writes beside the GGUF ones (folder names)."""

_SOURCES = (Precision.F16, Precision.F32)  # GGUF precisions the export reads losslessly
DATA_SUFFIX = ".data"  # the external data file: model.onnx.data beside model.onnx
EXTERNAL_DATA_BYTES = 3 << 29  # 1.5 GiB: past it, weights go to model.onnx.data (protobuf caps 2)
_DIR_MODE = 0o755


@dataclass(frozen=True, slots=True)
class GgufSource:
    """A GGUF read once for every folder exported from it (gguf's reader takes 5 s a pass
    over a 32,000-token vocabulary)."""

    path: Path
    config: ModelConfig
    weights: dict[str, F32Array]
    metadata: dict[str, str | int | float | bool]
    sha256: str
    vocab_gguf: bytes  # the tokenizer.gguf every folder carries

    @classmethod
    def read(cls, path: Path) -> GgufSource:
        """Read ``path``'s shape, float32 weights and metadata (F16/F32 files only)."""
        config, weights = read_llama_gguf(path)
        with tempfile.TemporaryDirectory() as tmp:
            write_vocab_gguf(path, Path(tmp) / TOKENIZER_FILE)
            vocab = (Path(tmp) / TOKENIZER_FILE).read_bytes()
        metadata = read_gguf_metadata(path)
        return cls(path, config, weights, metadata, sha256_file(path), vocab)

    def decoder_config(self, precision: Precision) -> DecoderConfig:
        """The config.json of this model exported at ``precision``."""
        c, meta = self.config, self.metadata
        return DecoderConfig(
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_kv_heads=c.kv_heads,
            head_dim=c.head_dim,
            n_embd=c.n_embd,
            n_ff=c.n_ff,
            n_vocab=c.vocab_size,
            n_ctx_train=c.context_length,
            rope_base=c.rope_base,
            norm_eps=c.norm_eps,
            bos_id=int(meta["tokenizer.ggml.bos_token_id"]),
            eos_id=int(meta["tokenizer.ggml.eos_token_id"]),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            tied_embeddings="output.weight" not in self.weights,
            precision=precision,
            source_sha256=self.sha256,
        )


def export_onnx(
    gguf: Path | GgufSource,
    dst: Path,
    precision: Precision | str,
    *,
    external_data: bool | None = None,
) -> DecoderConfig:
    """Write the folder ``dst`` (model.onnx, config.json, tokenizer.gguf) from a GGUF.

    ``dst`` is built beside itself and renamed into place, replacing what was
    there. ``external_data`` puts the weights in ``model.onnx.data`` (default:
    only past 1.5 GiB). Returns the config written.
    """
    source = gguf if isinstance(gguf, GgufSource) else GgufSource.read(gguf)
    precision = onnx_precision(precision)
    decoder = source.decoder_config(precision)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        staging.chmod(_DIR_MODE)
        model = build_decoder(source.weights, decoder)
        if external_data is None:
            external_data = _weight_bytes(model) > EXTERNAL_DATA_BYTES
        save_model(model, staging / MODEL_FILE, external_data=external_data)
        decoder.write(staging)
        (staging / TOKENIZER_FILE).write_bytes(source.vocab_gguf)
        _replace_dir(staging, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s -> %s (%s, %d bytes)", source.path.name, dst, precision, _size(dst))
    return decoder


def export_onnx_branches(
    gguf: Path,
    out_dir: Path,
    branches: Mapping[str, Precision] = DEMO_ONNX_BRANCHES,
    *,
    progress: bool = False,
) -> dict[str, Path]:
    """Export ``gguf`` once per branch into ``out_dir/<branch>/``; returns the folders.
    ``progress``: a bar per folder on stderr."""
    from tqdm import tqdm

    source = GgufSource.read(gguf)
    folders: dict[str, Path] = {}
    for name, precision in tqdm(
        branches.items(), desc="exporting ONNX", unit="folder", disable=not progress
    ):
        export_onnx(source, out_dir / name, precision)
        folders[name] = out_dir / name
    return folders


def add_onnx_branches(
    model_dir: Path,
    *,
    source: str | None = None,
    branches: Mapping[str, Precision] = DEMO_ONNX_BRANCHES,
    progress: bool = False,
) -> Manifest:
    """Export the model in ``model_dir`` as ONNX folders and declare them in its manifest.

    ``source`` is the GGUF branch exported (default: the reference, which must be
    an F16 or F32 file). Each of ``branches`` becomes ``model_dir/<branch>/``,
    declared ``engine: onnxruntime`` with its graph's and tokenizer's sha256 (and its
    ``data``, ``model.onnx.data`` with its sha256, where the export put the weights
    there); a branch of that name already declared is replaced. The folders land first, the
    manifest last (by rename), so a watcher sees the old model or the whole new
    one. Returns the manifest written.
    """
    manifest = load_manifest(model_dir)
    name = source or manifest.reference
    spec = manifest.branches.get(name)
    if spec is None or spec.engine != "llamacpp" or spec.precision not in _SOURCES:
        raise ValueError(f"{manifest.model}: the ONNX export reads an F16 or F32 GGUF branch")
    folders = export_onnx_branches(model_dir / spec.file, model_dir, branches, progress=progress)
    declared = dict(manifest.branches)
    for branch, folder in folders.items():
        data = folder / (MODEL_FILE + DATA_SUFFIX)
        declared[branch] = BranchSpec(
            file=f"{branch}/{MODEL_FILE}",
            precision=onnx_precision(branches[branch]),
            engine="onnxruntime",
            sha256=sha256_file(folder / MODEL_FILE),
            tokenizer=TokenizerFile(
                file=f"{branch}/{TOKENIZER_FILE}", sha256=sha256_file(folder / TOKENIZER_FILE)
            ),
            data=(
                DeclaredFile(file=f"{branch}/{data.name}", sha256=sha256_file(data))
                if data.is_file()
                else None
            ),
        )
    updated = manifest.model_copy(update={"branches": declared})
    with tempfile.TemporaryDirectory(dir=model_dir, prefix=".manifest-") as staging:
        os.replace(write_manifest(Path(staging), updated), model_dir / MANIFEST_NAME)
    return updated


def write_vocab_gguf(src: Path, dst: Path) -> None:
    """Write ``src``'s metadata (tokenizer, chat template, hyperparameters) without tensors.

    llama.cpp loads the result with ``vocab_only`` and tokenizes exactly as it
    does the whole file: it is the same metadata read by the same code. This is
    how llama.cpp ships its own tokenizer test vocabularies (``models/ggml-vocab-*.gguf``).
    """
    import gguf

    reader = _open_reader(src)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{src}: no general.architecture")
    arch = str(arch_field.contents())

    def build(writer: Any) -> None:
        for field in reader.fields.values():
            # the writer adds the architecture itself; GGUF.* are header pseudo-fields
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)

    _write_atomically(dst, arch, build)


# ---- files ---------------------------------------------------------------------------------------


def save_model(model: Any, dst: Path, *, external_data: bool = False) -> None:
    """Write ``model`` to ``dst``, its weights to ``<dst>.data`` if ``external_data``."""
    import onnx

    if external_data:
        onnx.save_model(
            model,
            dst,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=dst.name + DATA_SUFFIX,
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, dst)


def _weight_bytes(model: Any) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def _replace_dir(staging: Path, dst: Path) -> None:
    """Rename ``staging`` to ``dst``; an old ``dst`` is moved aside first, then deleted."""
    if not dst.exists():
        os.replace(staging, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(staging, dst)
    shutil.rmtree(old, ignore_errors=True)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())

"""``quantroute demo build``: train the tiny model and lay out its repository.

data (stdlib sources) → train (torch, seeded, fixed step count) → F32 GGUF
(GGUFWriter) → F16, Q8_0, Q4_K_M (llama.cpp's quantizer) → ``quantroute.yaml``.

The F32 file is an intermediate kept in a scratch folder and deleted unless
asked for. Files land in ``out_dir`` by rename, the manifest last, so a watcher
of that folder sees either the old model or the whole new one.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from quantroute.demo.data import DEFAULT_MAX_BYTES, load_corpus
from quantroute.demo.gguf_export import GgufVocab, MetadataValue, quantize_gguf, write_llama_gguf
from quantroute.demo.model import ModelConfig, TrainConfig
from quantroute.demo.vocab import VOCAB
from quantroute.registry.manifest import BranchSpec, Manifest, sha256_file, write_manifest
from quantroute.types import Precision

logger = logging.getLogger(__name__)

MODEL_NAME = "tiny-llama"
DEFAULT_REPO_DIR = Path(__file__).resolve().parent / "repo" / MODEL_NAME
"""Where the packaged demo model lives (and where ``build_demo`` writes by default)."""

# branch name -> precision; the first is the reference.
SHIPPED_BRANCHES: dict[str, Precision] = {
    "f16": Precision.F16,
    "q8_0": Precision.Q8_0,
    "q4_k_m": Precision.Q4_K_M,
}


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """Everything that decides the built model. Same config, same machine: same bytes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    max_corpus_bytes: int = DEFAULT_MAX_BYTES
    branches: tuple[tuple[str, Precision], ...] = tuple(SHIPPED_BRANCHES.items())
    keep_f32: bool = False


def build_demo(
    out_dir: Path = DEFAULT_REPO_DIR,
    *,
    steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    max_seconds: float | None = None,
    config: BuildConfig | None = None,
) -> Manifest:
    """Train the demo model and write its branches and manifest into ``out_dir``.

    ``steps``, ``seed`` and ``max_seconds`` override ``config.train``. The
    default config trains 1.9 M parameters for 1000 steps of 16 x 256 tokens:
    about 2.5 minutes on 2 idle cores with native bfloat16 (AVX512-BF16/AMX).
    ``max_seconds`` (default 280) caps training as a safety net for slower or
    busy machines (float32-only CPUs take about twice as long); a build stopped
    by it is valid but not reproducible, and says so in a warning. Returns the
    manifest written (reference ``f16``). Needs torch and tqdm (the ``train``
    extra) and llama-cpp-python.

    >>> build_demo(tmp / "tiny", steps=3, config=micro)  # doctest: +SKIP
    """
    cfg = config or BuildConfig()
    train_cfg = replace(
        cfg.train,
        seed=seed,
        steps=cfg.train.steps if steps is None else steps,
        max_seconds=cfg.train.max_seconds if max_seconds is None else max_seconds,
    )
    if train_cfg.steps < 1:
        raise ValueError("steps must be >= 1")
    if train_cfg.max_seconds <= 0:
        raise ValueError("max_seconds must be > 0")
    if importlib.util.find_spec("llama_cpp") is None:  # fail before training, not after
        raise RuntimeError("building the demo needs llama-cpp-python for quantizing")
    started = time.monotonic()

    from quantroute.demo import model as tiny  # torch lives behind this import

    corpus = load_corpus(seed=seed, max_bytes=cfg.max_corpus_bytes)
    params = tiny.init_params(cfg.model, seed)
    logger.info(
        "model: %d params (n_embd %d, n_layer %d, n_head %d, n_ff %d); %d steps of %dx%d tokens",
        tiny.count_params(cfg.model),
        cfg.model.n_embd,
        cfg.model.n_layer,
        cfg.model.n_head,
        cfg.model.n_ff,
        train_cfg.steps,
        train_cfg.batch_size,
        train_cfg.seq_len,
    )
    result = tiny.train(params, cfg.model, corpus.tokens, train_cfg, progress=progress)
    weights = tiny.to_numpy(params)

    description = (
        f"Byte-level Llama demo model ({tiny.count_params(cfg.model) / 1e6:.2f} M params) "
        f"trained by quantroute on {len(corpus.files)} Python {platform.python_version()} "
        f"standard library sources; {result.steps_run} steps, seed {seed}, "
        f"val loss {result.val_loss:.3f} nats/token."
    )
    extra: dict[str, str | int | float | bool] = {
        "quantroute.demo.seed": seed,
        "quantroute.demo.steps": result.steps_run,
        "quantroute.demo.batch_size": train_cfg.batch_size,
        "quantroute.demo.seq_len": train_cfg.seq_len,
        "quantroute.demo.lr": train_cfg.lr,
        "quantroute.demo.autocast": result.autocast,
        "quantroute.demo.train_tokens": result.tokens_seen,
        "quantroute.demo.corpus_files": len(corpus.files),
        "quantroute.demo.corpus_bytes": corpus.n_bytes,
        "quantroute.demo.python": platform.python_version(),
        "quantroute.demo.val_loss": result.val_loss,
    }

    manifest = write_branches(
        out_dir,
        weights,
        cfg.model,
        name=MODEL_NAME,
        description=description,
        extra=extra,
        branches=cfg.branches,
        threads=train_cfg.threads,
        keep_f32=cfg.keep_f32,
        progress=progress,
    )
    logger.info("built %s in %.0f s", out_dir, time.monotonic() - started)
    return manifest


def write_branches(
    out_dir: Path,
    weights: Mapping[str, npt.NDArray[np.float32]],
    model: ModelConfig,
    *,
    name: str,
    description: str,
    extra: Mapping[str, MetadataValue],
    branches: tuple[tuple[str, Precision], ...],
    vocab: GgufVocab = VOCAB,
    threads: int = 2,
    keep_f32: bool = False,
    progress: bool = True,
) -> Manifest:
    """Write trained weights as an F32 GGUF, quantize it to every branch, write the manifest.

    The F32 file lives in a scratch folder inside ``out_dir`` (deleted unless
    ``keep_f32``); branches land by rename, the manifest last. The first of
    ``branches`` is the reference. Returns the manifest written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
    try:
        f32 = scratch / "f32.gguf"
        write_llama_gguf(
            f32, weights, model, vocab=vocab, name=name, description=description, extra=extra
        )
        made = _quantize_all(f32, scratch, branches, threads=threads, progress=progress)
        specs: dict[str, BranchSpec] = {}
        for branch, precision in branches:
            filename = f"{branch}.gguf"
            os.replace(made[branch], out_dir / filename)
            specs[branch] = BranchSpec(
                file=filename, precision=precision, sha256=sha256_file(out_dir / filename)
            )
        if keep_f32:
            os.replace(f32, out_dir / "f32.gguf")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    manifest = Manifest(
        model=name, reference=branches[0][0], description=description, branches=specs
    )
    write_manifest(out_dir, manifest)
    sizes = ", ".join(
        f"{n} {(out_dir / s.file).stat().st_size / 1e6:.2f} MB" for n, s in specs.items()
    )
    logger.info("wrote %s: %s", out_dir, sizes)
    return manifest


def _quantize_all(
    f32: Path,
    scratch: Path,
    branches: tuple[tuple[str, Precision], ...],
    *,
    threads: int,
    progress: bool,
) -> dict[str, Path]:
    from tqdm import tqdm

    out: dict[str, Path] = {}
    for name, precision in tqdm(branches, desc="quantizing", unit="file", disable=not progress):
        dst = scratch / f"{name}.gguf"
        if precision is Precision.F32:
            shutil.copyfile(f32, dst)
        else:
            quantize_gguf(f32, dst, precision, threads=threads)
        out[name] = dst
    return out

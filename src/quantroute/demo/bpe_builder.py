"""``quantroute demo build --model stdlib-bpe-llama``: a demo model of the shape real ones have.

tiny-llama (354 byte tokens, 2 layers) hides what only breaks at real sizes:
a 32k vocabulary's logit rows, BPE merges, grouped-query attention, a chat
template with its own special tokens. This model has all of them::

    stdlib sources ─▶ byte-level BPE, 32,000 tokens (tokenizers, GPT-2 pre-tokenizer)
                   ─▶ token stream + ChatML conversations about the same sources
                   ─▶ train 8 layers, 8 query / 2 kv heads, 20.8 M params (torch, seeded,
                      in a child process: see train_process)
                   ─▶ F32 GGUF (tokenizer.ggml.model "gpt2", pre "gpt-2", ChatML template)
                   ─▶ F16, Q8_0, Q4_K_M ─▶ quantroute.yaml ─▶ profile.json (quantroute profile)

Its files come to about 80 MB, too large for git: :func:`~quantroute.demo.cache.ensure_demo_repo`
builds it once into a cache keyed by everything that decides its bytes.
"""

from __future__ import annotations

import importlib.util
import logging
import platform
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from quantroute.demo.bpe import BpeConfig, BpeVocab, train_bpe
from quantroute.demo.builder import SHIPPED_BRANCHES, write_branches
from quantroute.demo.chats import chat_examples, chat_tokens
from quantroute.demo.data import Source, select_sources
from quantroute.demo.gguf_export import MetadataValue
from quantroute.demo.model import ModelConfig, TrainConfig, count_params
from quantroute.demo.train_process import train_in_child
from quantroute.registry.manifest import Manifest
from quantroute.types import Precision

logger = logging.getLogger(__name__)

BPE_MODEL_NAME = "stdlib-bpe-llama"
TOKENIZER_FILE = "tokenizer.json"


def _default_model() -> ModelConfig:
    # vocab_size is replaced by the trained vocabulary's size at build time
    return ModelConfig(
        vocab_size=32_000,
        n_embd=256,
        n_layer=8,
        n_head=8,
        n_head_kv=2,
        n_ff=512,
        context_length=512,
    )


def _default_train() -> TrainConfig:
    # 360 steps of 2 x 512 tokens: about 7 minutes of float32 training on 2 idle cores
    # (1.1 s a step), 13 on the same VM's slow mode (2.2 s). The cap is a safety net for a
    # stuck build, not a budget: a build cut at 223 steps under load gave a model that
    # wrote only newlines, so it is set for every step at up to 3.3 s a step.
    return TrainConfig(
        steps=360,
        batch_size=2,
        seq_len=512,
        lr=3e-3,
        warmup_steps=30,
        max_seconds=1200.0,
        val_batches=8,
    )


@dataclass(frozen=True, slots=True)
class BpeBuildConfig:
    """Everything that decides the BPE demo model. Same config, same machine: same bytes.

    ``model.vocab_size`` is replaced by the size of the vocabulary trained from
    ``bpe``. ``chats_per_file`` conversations per source file are mixed into
    the training stream. With ``profile``, the built branches are profiled;
    ``profile_n_ctx`` / ``profile_max_chunks`` are passed to
    :func:`~quantroute.quality.profile_repo` (``None``: its defaults).
    """

    model: ModelConfig = field(default_factory=_default_model)
    train: TrainConfig = field(default_factory=_default_train)
    bpe: BpeConfig = field(default_factory=BpeConfig)
    max_corpus_bytes: int = 20_000_000  # every usable stdlib source (9.5 MB for 3.11)
    chats_per_file: int = 3
    branches: tuple[tuple[str, Precision], ...] = tuple(SHIPPED_BRANCHES.items())
    profile: bool = True
    profile_n_ctx: int | None = None
    # 24 of the calibration text's 47 chunks of 512: 6,120 scored tokens per branch.
    # Each chunk costs log-softmax over 255 rows of 32,000 logits, twice.
    profile_max_chunks: int | None = 24
    keep_f32: bool = False


@dataclass(frozen=True, slots=True)
class TrainingStream:
    """The token stream the model trains on, and what it was made of."""

    tokens: npt.NDArray[np.int32]  # [N]
    n_documents: int
    n_chats: int
    chat_tokens: int


def training_stream(
    sources: list[Source], vocab: BpeVocab, *, chats_per_file: int, seed: int
) -> TrainingStream:
    """Source files and ChatML conversations, in a seeded order, each led by ``<|endoftext|>``.

    Sources are tokenized as plain text (special tokens in them are not special).
    """
    docs = vocab.encode_batch([s.text for s in sources])
    chats = [
        chat_tokens(e, vocab) for e in chat_examples(sources, per_file=chats_per_file, seed=seed)
    ]
    order = docs + chats
    random.Random(seed).shuffle(order)
    bos = np.array([vocab.bos_id], dtype=np.int32)
    pieces = [part for doc in order for part in (bos, np.asarray(doc, dtype=np.int32))]
    tokens = np.concatenate([*pieces, bos])
    n_chat = sum(len(c) for c in chats)
    logger.info(
        "stream: %d files + %d conversations (%.1f %% of tokens), %d tokens",
        len(docs),
        len(chats),
        100 * n_chat / len(tokens),
        len(tokens),
    )
    return TrainingStream(tokens, len(docs), len(chats), n_chat)


def build_bpe_demo(
    out_dir: Path,
    *,
    config: BpeBuildConfig | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Manifest:
    """Train the BPE demo model; write its branches, manifest, tokenizer and profile.

    ``out_dir`` is the model folder (it ends up holding ``quantroute.yaml``,
    ``f16.gguf``, ``q8_0.gguf``, ``q4_k_m.gguf``, ``tokenizer.json`` and, with
    ``config.profile``, ``profile.json`` and ``profile.png``). The default config
    takes about 9 minutes on 2 cores; ``config.train.max_seconds`` caps
    training as a safety net (a build stopped by it is valid but not
    reproducible, and says so in a warning). Needs the ``train`` extra (torch,
    tokenizers) and llama-cpp-python. Programs calling it need the
    ``if __name__ == "__main__":`` guard of any multiprocessing program (the
    profiler runs each branch in a spawned process).
    """
    cfg = config or BpeBuildConfig()
    train_cfg = replace(cfg.train, seed=seed)
    if train_cfg.steps < 1:
        raise ValueError("steps must be >= 1")
    if train_cfg.max_seconds <= 0:
        raise ValueError("max_seconds must be > 0")
    for package, why in (("torch", "training"), ("tokenizers", "its vocabulary")):
        if importlib.util.find_spec(package) is None:
            raise RuntimeError(f"building the demo needs {package} for {why} (the train extra)")
    if importlib.util.find_spec("llama_cpp") is None:  # fail before training, not after
        raise RuntimeError("building the demo needs llama-cpp-python for quantizing")
    started = time.monotonic()

    sources = select_sources(seed=seed, max_bytes=cfg.max_corpus_bytes)
    n_bytes = sum(len(s.text.encode("utf-8")) for s in sources)
    logger.info(
        "corpus: %d files, %.1f MB; training the BPE vocabulary", len(sources), n_bytes / 1e6
    )
    vocab = train_bpe((s.text for s in sources), cfg.bpe, progress=progress)
    stream = training_stream(sources, vocab, chats_per_file=cfg.chats_per_file, seed=seed)
    model_cfg = replace(cfg.model, vocab_size=vocab.size)
    n_params = count_params(model_cfg)
    logger.info(
        "model: %d params (vocab %d, n_embd %d, n_layer %d, n_head %d, n_head_kv %d, n_ff %d); "
        "%d steps of %dx%d tokens",
        n_params,
        model_cfg.vocab_size,
        model_cfg.n_embd,
        model_cfg.n_layer,
        model_cfg.n_head,
        model_cfg.kv_heads,
        model_cfg.n_ff,
        train_cfg.steps,
        train_cfg.batch_size,
        train_cfg.seq_len,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".train-", dir=out_dir))
    try:
        weights, result = train_in_child(
            model_cfg,
            train_cfg,
            stream.tokens,
            bos_id=vocab.bos_id,
            work_dir=work,
            progress=progress,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    description = (
        f"Byte-level BPE Llama demo model ({n_params / 1e6:.1f} M params, {vocab.size} tokens, "
        f"{model_cfg.n_layer} layers, {model_cfg.n_head}/{model_cfg.kv_heads} query/kv heads, "
        f"ChatML) trained by quantroute on {len(sources)} Python {platform.python_version()} "
        f"standard library sources; {result.steps_run} steps, seed {seed}, "
        f"val loss {result.val_loss:.3f} nats/token."
    )
    extra: dict[str, MetadataValue] = {
        "quantroute.demo.seed": seed,
        "quantroute.demo.steps": result.steps_run,
        "quantroute.demo.batch_size": train_cfg.batch_size,
        "quantroute.demo.seq_len": train_cfg.seq_len,
        "quantroute.demo.lr": train_cfg.lr,
        "quantroute.demo.autocast": result.autocast,
        "quantroute.demo.train_tokens": result.tokens_seen,
        "quantroute.demo.corpus_files": len(sources),
        "quantroute.demo.corpus_bytes": n_bytes,
        "quantroute.demo.chat_examples": stream.n_chats,
        "quantroute.demo.python": platform.python_version(),
        "quantroute.demo.val_loss": result.val_loss,
        "quantroute.demo.hit_time_cap": result.hit_time_cap,
    }
    manifest = write_branches(
        out_dir,
        weights,
        model_cfg,
        name=BPE_MODEL_NAME,
        description=description,
        extra=extra,
        branches=cfg.branches,
        vocab=vocab,
        threads=train_cfg.threads,
        keep_f32=cfg.keep_f32,
        progress=progress,
    )
    vocab.save(out_dir / TOKENIZER_FILE)
    if cfg.profile:
        from quantroute.quality import format_table, profile_repo

        profiled = profile_repo(
            out_dir,
            n_ctx=cfg.profile_n_ctx,
            max_chunks=cfg.profile_max_chunks,
            n_threads=train_cfg.threads,
            progress=progress,
        )
        logger.info("profile:\n%s", format_table(profiled))
    logger.info("built %s in %.0f s", out_dir, time.monotonic() - started)
    return manifest

"""``quantroute profile``: measure every branch of a model against its reference.

The quality pass is llama.cpp's ``llama-perplexity --kl-divergence``: the
calibration text is tokenized once (with the reference's vocabulary and BOS),
cut into ``n_ctx``-token chunks; each chunk is evaluated from an empty KV
cache with its first token replaced by BOS, and only its second half is
scored: the logits at positions ``n_ctx/2 .. n_ctx-2`` predict tokens
``n_ctx/2+1 .. n_ctx-1``.

Each branch runs in a fresh child process, one after the other, reference
first. The reference's float32 logits of the scored rows go to a temporary
``.npy`` memory map that the other branches read chunk by chunk, so one model
is loaded at a time, memory stays bounded for any vocabulary, and each
branch's resident-memory growth and speed are its own, as they would be in
its serving worker. A crash inside an engine fails the profile, not the caller.

A branch runs on its engine's runner (``quality.runners``), chosen by the manifest's
``engine:``: a GGUF file through llama.cpp, with its default context parameters (flash
attention "auto") as llama-perplexity and quantroute's serving worker use; an ONNX
Runtime folder (``engine: onnxruntime``) through the serving worker's own ``OnnxModel``.
Either way the logits scored are the logits served, and quality, memory and speed are
measured by the same code for both. The plan tokenizes with the reference's vocabulary
(an ONNX reference's ``tokenizer.gguf``); every branch must have its size.

Speed is sampled at eight chunks spread over each branch's pass: prefill as the
chunk evaluated from empty with only its last logits requested, decode as greedy
single-token steps after a short prompt. The best sample is kept, as ``timeit``
does: other load on the machine only ever slows a run down, and spreading the
samples out keeps a burst of it from spoiling them all.

A remote branch (a ``url`` in the manifest) is measured after the files, over
HTTP, on the same chunks: its server's top-k log-probabilities against the
reference's logits (``quality.remote``; the KLD is then a lower bound). The
reference must be a local branch.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from quantroute.errors import ArtifactIntegrityError, ConfigError, EngineError
from quantroute.quality.metrics import KldAccumulator, QualityStats
from quantroute.quality.plot import PLOT_NAME, plot_profiles, render_table
from quantroute.quality.profile import (
    FULL,
    BranchProfile,
    Fidelity,
    Measure,
    ProfileMethod,
    profile_key,
    to_file,
    write_profile,
)
from quantroute.quality.profile import ModelProfileResult as ModelProfileResult  # old home
from quantroute.quality.profile import ProfileResult as ProfileResult
from quantroute.quality.profile import find_model_dirs as find_model_dirs
from quantroute.quality.runners import (
    ONNX_ENGINE,
    LlamaRunner,
    Runner,
    TokenArray,
    onnxruntime_version,
    open_runner,
)
from quantroute.registry.manifest import BranchArtifact, check_artifacts, load_manifest

logger = logging.getLogger(__name__)
_LlamaRunner = LlamaRunner  # its old name and home (tests/demo import it from here)

DEFAULT_N_CTX = 512  # llama-perplexity's default; capped at the model's training context
DEFAULT_DECODE_TOKENS = 128
DEFAULT_TOP_K = 20  # a remote branch's listed tokens per position (quality.remote)
SPEED_SAMPLES = 8  # speed measurements per branch, spread over its pass


def default_calibration_text() -> str:
    """The packaged calibration text: ~80 KB of held-out Python source (see its header)."""
    return (resources.files("quantroute.quality") / "data" / "calibration.txt").read_text("utf-8")


# ---- the calibration plan ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Plan:
    chunks: tuple[TokenArray, ...]  # each [n_ctx], first token already BOS
    targets: tuple[TokenArray, ...]  # each [n_ctx - 1 - first]
    n_ctx: int
    n_vocab: int
    text_sha256: str

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.first


def _plan(vocab: LlamaRunner, text: str, n_ctx: int, max_chunks: int | None) -> _Plan:
    tokens = vocab.tokenize(text)  # [N]
    if len(tokens) < 2 * n_ctx:
        raise ConfigError(
            f"the calibration text is {len(tokens)} tokens; "
            f"n_ctx={n_ctx} needs at least {2 * n_ctx}"
        )
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = max(1, min(n_chunks, max_chunks))
    first = n_ctx // 2
    chunks, targets = [], []
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx].copy()  # [n_ctx]
        targets.append(chunk[first + 1 :].copy())  # [n_ctx - 1 - first], the original tokens
        if vocab.add_bos:
            chunk[0] = vocab.bos
        chunks.append(chunk)
    return _Plan(
        chunks=tuple(chunks),
        targets=tuple(targets),
        n_ctx=n_ctx,
        n_vocab=vocab.n_vocab,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )


def _decode_lengths(n_ctx: int, decode_tokens: int) -> tuple[int, int]:
    prompt = max(1, min(64, n_ctx // 4))
    return prompt, max(1, min(decode_tokens, n_ctx - prompt))


# ---- measuring one branch (in its own process) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Job:
    name: str  # the branch's file as the manifest names it (an ONNX one: folder/model.onnx)
    path: Path
    engine: str  # the manifest's engine: which runner loads it (quality.runners)
    tokenizer: Path | None  # an ONNX branch's tokenizer.gguf
    data: Path | None  # ... and its graph's external data file, if any
    is_reference: bool
    plan: _Plan
    cache_path: Path  # the reference's logits, [n_chunks, n_scored, V] float32
    n_threads: int
    decode_tokens: int


@dataclass(frozen=True, slots=True)
class _Measured:
    quality: QualityStats
    rss_bytes: int
    prefill_tps: float
    decode_tps: float
    fidelity: Fidelity = FULL


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _measure(job: _Job, tick: Callable[[], None]) -> _Measured:
    plan = job.plan
    n_prompt, n_gen = _decode_lengths(plan.n_ctx, job.decode_tokens)
    # Speed samples are spread over the whole pass, so a burst of other load on
    # the machine cannot spoil all of them; the best one is kept.
    n = len(plan.chunks)
    sample_at = {round(k * (n - 1) / max(1, SPEED_SAMPLES - 1)) for k in range(SPEED_SAMPLES)}
    prefill_s: list[float] = []
    decode_s: list[float] = []
    rss_before = _rss()
    runner = open_runner(
        job.engine,
        job.path,
        job.tokenizer,
        n_ctx=plan.n_ctx,
        n_threads=job.n_threads,
        data=job.data,
    )
    with runner as llm:
        if llm.n_vocab != plan.n_vocab:
            raise ConfigError(
                f"{job.name} has {llm.n_vocab} tokens; the reference has {plan.n_vocab}"
            )
        cache = np.load(job.cache_path, mmap_mode="r+" if job.is_reference else "r")
        acc = KldAccumulator()
        rss: int | None = None
        for i, chunk in enumerate(plan.chunks):
            tokens = chunk.tolist()
            llm.clear()
            rows = llm.decode(tokens, pos0=0, rows=(plan.first, plan.n_ctx - 1))  # [S, V]
            if rss is None:  # weights paged in, KV cache and compute buffers allocated
                rss = max(0, _rss() - rss_before)
            if job.is_reference:
                cache[i] = rows
            acc.add_logits(cache[i], rows, plan.targets[i])
            if i in sample_at:
                prefill_s.append(_time_prefill(llm, tokens))
                decode_s.append(_time_decode(llm, tokens[:n_prompt], n_gen))
            tick()
        if job.is_reference:
            cache.flush()
        del cache
    return _Measured(
        quality=acc.result(),
        rss_bytes=rss or 0,
        prefill_tps=plan.n_ctx / min(prefill_s),
        decode_tps=n_gen / min(decode_s),
    )


def _time_prefill(llm: Runner, tokens: list[int]) -> float:
    """Seconds to evaluate ``tokens`` from an empty cache, only the last logits requested."""
    llm.clear()
    t0 = time.perf_counter()
    llm.decode(tokens, pos0=0, rows=(len(tokens) - 1, len(tokens)))
    return time.perf_counter() - t0


def _time_decode(llm: Runner, prompt: list[int], n_gen: int) -> float:
    """Seconds for ``n_gen`` greedy single-token steps after ``prompt``."""
    llm.clear()
    logits = llm.decode(prompt, pos0=0, rows=(len(prompt) - 1, len(prompt)))  # [1, V]
    tok = int(np.argmax(logits[0]))
    t0 = time.perf_counter()
    for k in range(n_gen):
        logits = llm.decode([tok], pos0=len(prompt) + k, rows=(0, 1))  # [1, V]
        tok = int(np.argmax(logits[0]))
    return time.perf_counter() - t0


def _child_main(job: _Job, conn: Connection) -> None:
    """Entry point of a branch's process: ticks per chunk, then the result or an error."""
    try:
        result = _measure(job, lambda: conn.send(("tick", None)))
    except Exception as exc:  # reported to the parent, which raises
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    else:
        conn.send(("done", result))
    finally:
        conn.close()


def _measure_in_child(job: _Job, advance: Callable[[], None]) -> _Measured:
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(job, sender), name=f"profile-{job.name}")
    proc.start()
    sender.close()
    result: _Measured | None = None
    error = ""
    try:
        while True:
            try:
                kind, payload = receiver.recv()
            except EOFError:
                break
            if kind == "tick":
                advance()
            elif kind == "done":
                result = payload
            else:
                error = str(payload)
    finally:
        receiver.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if result is None:
        reason = error or f"its process exited with code {proc.exitcode}"
        raise EngineError(f"profiling {job.name} failed: {reason}")
    return result


# ---- whole models and repositories --------------------------------------------------------------


@contextmanager
def _progress(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    bar: Any = None
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # progress is a nicety; the table still prints
            bar = None
        else:
            bar = tqdm(
                total=total, desc=desc, unit="chunk", file=sys.stderr, leave=False, disable=None
            )  # disable=None: no bar when stderr is not a terminal
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def profile_model(
    model_dir: Path | str,
    *,
    text: str | None = None,
    n_ctx: int | None = None,
    max_chunks: int | None = None,
    n_threads: int | None = None,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    progress: bool = True,
    plot: bool = True,
    top_k: int = DEFAULT_TOP_K,
    secret: Callable[[str], str | None] = lambda _name: None,
) -> ModelProfileResult:
    """Profile every branch of the model in ``model_dir``; write ``profile.json`` (and a plot).

    See :func:`profile_repo` for the arguments.
    """
    started = time.perf_counter()
    model_dir = Path(model_dir)
    manifest = load_manifest(model_dir)
    artifacts = check_artifacts(model_dir, manifest, isolated=True)  # reference first
    local = [a for a in artifacts if a.url is None]  # every file must be sound
    if problem := next((a.problem for a in local if a.problem is not None), None):
        raise ArtifactIntegrityError(problem)
    reference = artifacts[0]
    if reference.url is not None:
        raise ConfigError(
            f"{manifest.model}: profiling needs the reference's logits: a local branch"
        )
    threads = n_threads or len(os.sched_getaffinity(0))
    text = default_calibration_text() if text is None else text

    vocab_file = reference.tokenizer_path if reference.engine == ONNX_ENGINE else None
    with LlamaRunner(vocab_file or reference.path, vocab_only=True) as vocab:
        n_ctx_train = vocab.n_ctx_train()
        ctx_len = n_ctx or min(DEFAULT_N_CTX, n_ctx_train or DEFAULT_N_CTX)
        if n_ctx_train and ctx_len > n_ctx_train:
            logger.warning("%s: n_ctx %d > its training context", manifest.model, ctx_len)
        plan = _plan(vocab, text, ctx_len, max_chunks)
    logger.info("%s: %d chunks of %d tokens", manifest.model, len(plan.chunks), plan.n_ctx)

    measured: list[tuple[BranchArtifact, _Measured, datetime]] = []
    with tempfile.TemporaryDirectory(prefix="quantroute-profile-") as tmp:
        cache_path = Path(tmp) / "reference_logits.npy"
        np.lib.format.open_memmap(
            cache_path,
            mode="w+",
            dtype=np.float32,
            shape=(len(plan.chunks), plan.n_scored, plan.n_vocab),
        ).flush()
        with _progress(len(plan.chunks) * len(artifacts), progress, manifest.model) as bar:
            for art in local:
                if bar is not None:
                    bar.set_postfix_str(art.name)
                job = _Job(
                    name=art.spec.file if art.spec is not None else art.path.name,
                    path=art.path,
                    engine=art.engine,
                    tokenizer=art.tokenizer_path,
                    data=art.data_path,
                    is_reference=art is reference,
                    plan=plan,
                    cache_path=cache_path,
                    n_threads=threads,
                    decode_tokens=decode_tokens,
                )
                m = _measure_in_child(job, bar.update if bar is not None else lambda: None)
                measured.append((art, m, datetime.now(UTC).replace(microsecond=0)))
                logger.info("%s:%s measured: %s", manifest.model, art.name, m)
            remotes = [a for a in artifacts if a.url is not None]
            if remotes:
                from quantroute.quality.remote import measure_remote_branches

                chunks = [c.tolist() for c in plan.chunks]
                tick = bar.update if bar is not None else lambda: None
                for art, r in measure_remote_branches(
                    remotes, chunks, plan.targets, plan.first, cache_path,
                    k=top_k, secret=secret, tick=tick,
                ):  # fmt: skip
                    m = _Measured(r.quality, 0, 0.0, 0.0, r.fidelity)
                    measured.append((art, m, datetime.now(UTC).replace(microsecond=0)))

    import llama_cpp

    method = ProfileMethod(
        calibration_sha256=plan.text_sha256,
        n_ctx=plan.n_ctx,
        n_chunks=len(plan.chunks),
        n_scored_tokens=len(plan.chunks) * plan.n_scored,
        reference_branch=reference.name,
        llama_cpp_version=f"llama-cpp-python {llama_cpp.__version__}",
        n_threads=threads,
        decode_tokens=_decode_lengths(plan.n_ctx, decode_tokens)[1],
        onnxruntime_version=(
            onnxruntime_version() if any(a.engine == ONNX_ENGINE for a in local) else None
        ),
    )
    profiles = tuple(
        BranchProfile(
            model=manifest.model,
            branch=art.name,
            precision=art.precision,
            sha256=profile_key(art),
            quality=m.quality,
            file_bytes=art.size_bytes,
            rss_bytes=m.rss_bytes,
            prefill_tps=m.prefill_tps,
            decode_tps=m.decode_tps,
            measured_at=at,
            fidelity=m.fidelity,
        )
        for art, m, at in measured
    )
    path = write_profile(model_dir, to_file(manifest.model, reference, method, profiles))
    plot_path = None
    if plot:
        try:
            plot_path = plot_profiles(manifest.model, profiles, model_dir / PLOT_NAME)
        except ImportError:
            logger.warning("matplotlib is not installed: no %s for %s", PLOT_NAME, manifest.model)
    return ModelProfileResult(
        model=manifest.model,
        model_dir=model_dir,
        profile_path=path,
        plot_path=plot_path,
        method=method,
        branches=profiles,
        elapsed_s=time.perf_counter() - started,
    )


def profile_repo(
    repo: Path | str,
    *,
    model: str | None = None,
    text: str | None = None,
    n_ctx: int | None = None,
    max_chunks: int | None = None,
    n_threads: int | None = None,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    progress: bool = True,
    plot: bool = True,
    top_k: int = DEFAULT_TOP_K,
    secret: Callable[[str], str | None] = lambda _name: None,
) -> ProfileResult:
    """Profile each model under ``repo`` (a repository of model folders, or one model folder).

    - ``model``: only the model with this name (``NotFoundError`` if absent).
    - ``text``: calibration text; default the packaged held-out Python source.
    - ``n_ctx``: chunk length; default ``min(512, the model's training context)``.
    - ``max_chunks``: score at most this many chunks; default all the text gives.
    - ``n_threads``: CPU threads for llama.cpp and ONNX Runtime; default every CPU this
      process may use.
    - ``decode_tokens``: greedy tokens timed for decode speed (fewer if ``n_ctx`` is short).
    - ``progress``: a tqdm bar on stderr; ``plot``: write ``profile.png`` beside the profile.
    - ``top_k``: tokens to ask a remote branch (``url``) for per position (quality.remote);
      ``secret``: reads the variable its ``api_key_env`` names (``Settings.secret``).

    Each model folder gets ``profile.json`` (and ``profile.png``). The quality
    numbers are deterministic for a given text, ``n_ctx``, file set and
    thread count; speed and memory are measurements and vary.
    """
    started = time.perf_counter()
    results = tuple(
        profile_model(
            d,
            text=text,
            n_ctx=n_ctx,
            max_chunks=max_chunks,
            n_threads=n_threads,
            decode_tokens=decode_tokens,
            progress=progress,
            plot=plot,
            top_k=top_k,
            secret=secret,
        )
        for d in find_model_dirs(repo, model)
    )
    return ProfileResult(models=results, elapsed_s=time.perf_counter() - started)


# ---- the results table -------------------------------------------------------------------------


def format_table(result: ProfileResult | ModelProfileResult) -> str:
    """The results as a plain-text table per model, for a terminal or a Markdown code block."""
    models = result.models if isinstance(result, ProfileResult) else (result,)
    return "\n\n".join(_table(m) for m in models) + "\n"


def _table(m: ModelProfileResult) -> str:
    notes = [
        f"{p.branch}: from its server's top-{p.fidelity.top_k} log-probabilities "
        f"({p.fidelity.dialect}); KLD is a lower bound, the reference's mass outside the "
        f"listed tokens {100 * p.fidelity.tail_mass:.2f} %"
        for p in m.branches
        if p.fidelity.measure is Measure.TOPK
    ]
    return "\n".join([render_table(m.model, m.method, m.branches, m.elapsed_s), *notes])

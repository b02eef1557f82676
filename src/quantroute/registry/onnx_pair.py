"""An ONNX branch's files, checked together: the graph
(:mod:`quantroute.registry.onnx_check`), its tokenizer, and the size and name of its
external data file where it declares one (:class:`~quantroute.registry.onnx_check.DataFile`:
its bytes were verified by sha256; the graph's tensors must lie inside it).

The tokenizer is a GGUF file checked by :func:`~quantroute.registry.gguf_check.check_gguf`
with its metadata; it needs a vocabulary (``general.architecture``,
``tokenizer.ggml.model``, ``tokenizer.ggml.tokens``), no tensors, and no more
tokens than the graph has logits (:func:`check_vocabulary`); its shape metadata
(training context, heads, widths) completes the graph's :class:`OnnxSummary`.

:func:`check_onnx_isolated` checks pairs in a child process bounded in time (a
wall clock and ``RLIMIT_CPU``) and memory (``RLIMIT_AS``),
``python -m quantroute.registry.onnx_child``, as the GGUF check does its files,
and keeps each sound graph's summary; :func:`read_onnx_isolated` is what the
memory model asks (``telemetry.memory``), so the gateway never parses a model
file itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from quantroute.engines.environment import worker_env
from quantroute.errors import ArtifactIntegrityError
from quantroute.registry.gguf_check import (
    CHILD_MEMORY_BYTES,
    CHILD_TIMEOUT_S,
    GgufSummary,
    check_gguf,
)
from quantroute.registry.onnx_check import DataFile, OnnxSummary, check_onnx

__all__ = [
    "PairFound",
    "check_onnx_isolated",
    "check_onnx_pair",
    "check_vocabulary",
    "data_arg",
    "pair_json",
    "parse_data_arg",
    "read_onnx_isolated",
]


def check_vocabulary(
    tokenizer: GgufSummary, model: OnnxSummary | None = None
) -> OnnxSummary | None:
    """Refuse a tokenizer GGUF without a vocabulary (or with more tokens than ``model``'s
    logits); return ``model`` with the tokenizer's shape metadata."""
    meta = tokenizer.metadata
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens#count")
    if not isinstance(arch, str) or not isinstance(meta.get("tokenizer.ggml.model"), str):
        raise ArtifactIntegrityError("a tokenizer without its vocabulary's metadata")
    if not isinstance(tokens, int) or tokens < 1:
        raise ArtifactIntegrityError("a tokenizer without tokens")
    if model is None:
        return None
    if model.n_vocab and tokens > model.n_vocab:
        raise ArtifactIntegrityError(
            f"the tokenizer has {tokens} tokens and the graph's logits {model.n_vocab}"
        )

    def number(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0

    return replace(
        model,
        n_vocab=model.n_vocab or tokens,
        n_ctx_train=number("context_length"),
        n_head=number("attention.head_count"),
        n_embd=number("embedding_length"),
        n_ff=number("feed_forward_length"),
    )


@dataclass(frozen=True, slots=True)
class PairFound:
    """One ONNX branch's check: the graph's summary (with its tokenizer's shape), or
    why the graph (``model``) or the tokenizer (``tokenizer``) is refused."""

    summary: OnnxSummary | None = None
    model: str | None = None
    tokenizer: str | None = None


def check_onnx_pair(model: Path, tokenizer: Path | None, data: DataFile | None = None) -> PairFound:
    """:func:`check_onnx` of ``model`` (its external tensors against ``data``) and the
    vocabulary check of ``tokenizer``, in this process (the child's work; a caller that
    trusts no file uses the isolated one)."""
    try:
        summary = check_onnx(model, data)
    except ArtifactIntegrityError as exc:
        return PairFound(model=exc.message)
    if tokenizer is None:
        return PairFound(summary)
    try:
        combined = check_vocabulary(check_gguf(tokenizer, metadata=True), summary)
    except ArtifactIntegrityError as exc:
        return PairFound(tokenizer=exc.message)
    return PairFound(combined)


def check_onnx_isolated(
    pairs: list[tuple[Path, Path | None]],
    *,
    data: list[DataFile | None] | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
    memory_bytes: int = CHILD_MEMORY_BYTES,
) -> list[PairFound]:
    """:func:`check_onnx_pair` of each ``(model, tokenizer)`` (with ``data``'s entry: its
    external data file, if any) in one child process bounded in time and memory; a
    child that runs out of either, or dies, is tried again with each pair alone, so that
    only the graph that did it is refused (with that reason). Each sound graph's summary
    is kept (while its size, mtime and ctime are the ones checked) for
    :func:`read_onnx_isolated`. Blocking: call it off the event loop."""
    files: list[DataFile | None] = list(data) if data is not None else [None] * len(pairs)
    if len(files) != len(pairs):
        raise ValueError("data needs one entry per pair")
    found = _run_child(pairs, files, timeout_s, memory_bytes)
    failed = [f.model is not None and f.model.startswith(_CHILD_FAILED) for f in found]
    if len(pairs) > 1 and all(failed):
        found = [
            alone
            for pair, file in zip(pairs, files, strict=True)
            for alone in _run_child([pair], [file], timeout_s, memory_bytes)
        ]
    return found


_CHILD_FAILED = "the ONNX check "  # how a whole child's failure begins


def _run_child(
    pairs: list[tuple[Path, Path | None]],
    files: list[DataFile | None],
    timeout_s: float,
    memory_bytes: int,
) -> list[PairFound]:
    """One child over ``pairs``: what :func:`check_onnx_isolated` says of each, or the
    child's failure for all of them."""
    if not pairs:
        return []
    before = [_stat_key(m) for m, _ in pairs]
    argv = [sys.executable, "-m", "quantroute.registry.onnx_child", "--memory-bytes"]
    argv.append(str(memory_bytes))
    for (model, tokenizer), file in zip(pairs, files, strict=True):
        argv += [str(model), str(tokenizer) if tokenizer is not None else "-", data_arg(file)]
    # the workers' allowlisted environment: no key of the gateway's reaches a hostile file
    env = worker_env(os.environ) | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return [PairFound(model=f"{_CHILD_FAILED}took over {timeout_s:g} s (refused)")] * len(pairs)
    found = _answers(done.stdout, len(pairs))
    if done.returncode != 0 or found is None:
        code = done.returncode
        status = f"exit status {code}" if code >= 0 else f"signal {-code}"
        why = f"{_CHILD_FAILED}failed ({status}; over its memory limit?)"
        return [PairFound(model=why)] * len(pairs)
    for (model, _), key, answer in zip(pairs, before, found, strict=True):
        if answer.summary is not None and key is not None and _stat_key(model) == key:
            with _LOCK:
                if len(_SUMMARIES) >= _SUMMARIES_MAX:
                    _SUMMARIES.pop(next(iter(_SUMMARIES)))
                _SUMMARIES[key] = answer.summary
    return found


def read_onnx_isolated(
    path: Path,
    *,
    data: DataFile | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
    memory_bytes: int = CHILD_MEMORY_BYTES,
) -> OnnxSummary:
    """The summary of the ONNX graph at ``path``: what the last isolated check of the same
    file found (with its tokenizer's shape), or a new check of the graph alone (and its
    external tensors against ``data``) in a child process bounded in time and memory.
    Raises :class:`ArtifactIntegrityError` with the reason it is refused. Blocking: call
    it off the event loop."""
    key = _stat_key(path)
    if key is not None:
        with _LOCK:
            summary = _SUMMARIES.get(key)
        if summary is not None:
            return summary
    (found,) = check_onnx_isolated(
        [(path, None)], data=[data], timeout_s=timeout_s, memory_bytes=memory_bytes
    )
    if found.summary is None:
        raise ArtifactIntegrityError(found.model or "the ONNX check failed")
    return found.summary


_StatKey = tuple[str, int, int, int, int, int]
_SUMMARIES: dict[_StatKey, OnnxSummary] = {}
_SUMMARIES_MAX = 256
_LOCK = threading.Lock()


def _stat_key(path: Path) -> _StatKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def data_arg(data: DataFile | None) -> str:
    """``data`` on the child's command line: ``SIZE:NAME``, or ``-`` for none."""
    return "-" if data is None or data.name is None else f"{data.size}:{data.name}"


def parse_data_arg(arg: str) -> DataFile | None:
    """:func:`data_arg`'s inverse (the child's)."""
    if arg == "-":
        return None
    size, _, name = arg.partition(":")
    return DataFile(name, int(size))


def pair_json(found: PairFound) -> dict[str, Any]:
    """``found`` as JSON (what the child writes)."""
    summary = asdict(found.summary) if found.summary is not None else None
    return {"summary": summary, "model": found.model, "tokenizer": found.tokenizer}


_NUMBERS = tuple(f.name for f in fields(OnnxSummary))


def _answers(stdout: bytes, n: int) -> list[PairFound] | None:
    try:
        answers = json.loads(stdout)
    except ValueError:
        return None
    if not isinstance(answers, list) or len(answers) != n:
        return None
    found = []
    for answer in answers:
        if not isinstance(answer, dict):
            return None
        summary = answer.get("summary")
        model, tokenizer = answer.get("model"), answer.get("tokenizer")
        if isinstance(summary, dict):
            try:
                values: dict[str, Any] = {k: int(summary[k]) for k in _NUMBERS}
                values["keeps_rows"] = bool(values["keeps_rows"])
                found.append(PairFound(OnnxSummary(**values)))
            except (KeyError, TypeError, ValueError):
                return None
        elif isinstance(model, str) or isinstance(tokenizer, str):
            found.append(
                PairFound(
                    model=model if isinstance(model, str) else None,
                    tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                )
            )
        else:
            return None
    return found

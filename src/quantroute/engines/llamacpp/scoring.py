"""What a llama.cpp worker does with teacher-forced logits (the drift monitor's replay).

The reference's worker writes its rows to a file (:class:`LogitsDump`); the
branch's worker reads them back a row at a time and compares
(:class:`Comparison`), so that a ``[T, V]`` array never crosses a pipe, nor
sits whole in any process's memory.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Protocol

import numpy as np

from quantroute.engines.llamacpp import wire


class ScoringJob(Protocol):
    """What a scoring sequence does with each row of logits that predicted one of its tokens."""

    def add(self, logits: np.ndarray[Any, Any]) -> None:
        """One row, ``[V]`` float32 (a view into llama.cpp's buffer: use it now)."""

    def result(self, rid: str) -> wire.Logits | wire.Scores:
        """The event that answers job ``rid``, once every row was added."""

    def close(self) -> None:
        """Release files; a job that did not finish leaves nothing behind."""


class LogitsDump:
    """Writes a job's logits rows to a new file at ``path`` (``O_EXCL``: never an
    existing file, nor through a link); removed again unless the job finished."""

    def __init__(self, path: str, n_tokens: int, n_vocab: int, ids: tuple[int, ...] = ()):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._file = os.fdopen(os.open(path, flags, 0o600), "wb")
        self.path = path
        self.shape = (n_tokens, n_vocab)
        self.ids = ids  # the prompt's tokens, then the scored ones
        self._rows = 0
        self._done = False

    def add(self, logits: np.ndarray[Any, Any]) -> None:
        self._file.write(logits.data)  # [V] float32, as llama.cpp returned it
        self._rows += 1

    def result(self, rid: str) -> wire.Logits:
        if self._rows != self.shape[0]:
            raise ValueError(f"{self._rows} rows of logits for {self.shape[0]} tokens")
        self._file.close()  # flushes: a full file system raises here, not later
        self._done = True
        return wire.Logits(rid, self.path, self.shape, self.ids)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a write that failed already said why
            self._file.close()
        if not self._done:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class Comparison:
    """Compares a job's rows with a reference's logits file, one row at a time: per-token
    ``KL(ref ‖ this)`` and top-1 agreement, by ``quantroute.divergence``."""

    def __init__(self, path: str, shape: tuple[int, int], n_tokens: int, n_vocab: int):
        # Imported on the first comparison only: it costs a worker that never scores
        # nothing at start-up.
        from quantroute import divergence

        self._metrics = divergence
        rows, vocab = shape
        if vocab != n_vocab:
            raise ValueError(
                f"the reference's vocabulary ({vocab}) is not this model's ({n_vocab})"
            )
        if rows != n_tokens:
            raise ValueError(f"the reference has {rows} rows for {n_tokens} tokens")
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        size = os.fstat(self._file.fileno()).st_size
        if size != rows * vocab * 4:
            self._file.close()
            raise ValueError(
                f"the reference's file holds {size} bytes, not {rows} x {vocab} float32"
            )
        self._ref = np.empty(vocab, dtype=np.float32)  # [V], reused for every row
        self._kld: list[float | None] = []  # None: infinite (JSON has no infinity)
        self._top1: list[bool] = []

    def add(self, logits: np.ndarray[Any, Any]) -> None:
        if self._file.readinto(self._ref.data.cast("B")) != self._ref.nbytes:
            raise ValueError("the reference's file ended early")
        m = self._metrics
        ref = m.log_softmax(self._ref[None, :])  # [1, V] float64
        q = m.log_softmax(logits[None, :])  # [1, V] float64
        kld = float(m.kl_divergence(ref, q)[0])
        self._kld.append(None if math.isinf(kld) else kld)
        self._top1.append(bool(m.top1_agreement(ref, q)[0]))

    def result(self, rid: str) -> wire.Scores:
        return wire.Scores(rid, self._kld, self._top1)

    def close(self) -> None:
        self._file.close()

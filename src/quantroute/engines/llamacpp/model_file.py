"""The files a llama.cpp worker loads: only the bytes that were verified (gateway side;
``registry.verified``).

A worker loads its model (a GGUF, or an ONNX folder's ``model.onnx``) and, for an ONNX
branch, the folder's ``tokenizer.gguf`` and, where the graph's weights lie beside it,
its ``model.onnx.data`` (``--onnx-data``) (:class:`WorkerFiles`). Before each spawn the
engine opens each verified file and checks the descriptor against the verification (a
file that changed is refused: the branch fails, in words); the worker loads those
descriptors (``/proc/self/fd/N``), and the engine keeps them open while the worker
lives, to find a rewrite in place (:meth:`ModelFile.moved`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from quantroute.engines.llamacpp.options import WorkerOptions
from quantroute.engines.supervisor import Launch
from quantroute.registry.verified import VerifiedFile


class ModelFile:
    """A branch's verified file and the descriptor its current worker loaded."""

    def __init__(self, verified: VerifiedFile):
        self._verified = verified
        self._fd: int | None = None  # the open file the current worker loaded

    async def open(self) -> int:
        """Open the file and prove it holds the verified bytes (in a thread: it may read
        the whole file); the descriptor stays open until :meth:`release`. Raises what
        :meth:`VerifiedFile.open` raises for a file that changed."""
        self.release()
        opening = asyncio.ensure_future(asyncio.to_thread(self._verified.open))
        try:
            fd, self._verified = await asyncio.shield(opening)
        except asyncio.CancelledError:  # a stop during the check: close what it opens
            opening.add_done_callback(_close_opened)
            raise
        self._fd = fd
        return fd

    def release(self) -> None:
        """Close the descriptor (the worker that loaded it is gone)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def moved(self) -> str | None:
        """Why the file the running worker loaded is no longer the verified one (it was
        rewritten in place), in words; ``None`` while it holds or nothing is open."""
        return None if self._fd is None else self._verified.moved(self._fd)


class WorkerFiles:
    """The files one engine's workers load: ``model`` (verified as ``verified``; ``None``:
    a file nothing verified, tests' own, loaded by its path), an ONNX branch's
    ``tokenizer`` (a :class:`VerifiedFile`, or an unverified path; ``None`` for a GGUF)
    and its graph's external ``data`` file, the same way (``None``: none)."""

    def __init__(
        self,
        model: Path,
        verified: VerifiedFile | None,
        tokenizer: VerifiedFile | Path | None,
        data: VerifiedFile | Path | None = None,
    ):
        self._paths = (model, _path(tokenizer), _path(data))
        self._model = ModelFile(verified) if verified is not None else None
        self._tokenizer = ModelFile(tokenizer) if isinstance(tokenizer, VerifiedFile) else None
        self._data = ModelFile(data) if isinstance(data, VerifiedFile) else None

    @property
    def verified(self) -> bool:
        """Some file is verified: each spawn must :meth:`launch` (open and check) first."""
        return any(f is not None for f in self._files)

    @property
    def _files(self) -> tuple[ModelFile | None, ModelFile | None, ModelFile | None]:
        return self._model, self._tokenizer, self._data

    def argv(self, options: WorkerOptions) -> list[str]:
        """The worker's argv with the files by their paths (a spawn with nothing to check)."""
        return _argv(options, *self._paths)

    async def launch(self, options: WorkerOptions) -> Launch:
        """Before a spawn: open each verified file and prove it holds the verified bytes;
        the worker loads those descriptors (it inherits them), the others by path."""
        fds: list[int] = []
        args: list[Path | None] = list(self._paths)
        try:
            for i, file in enumerate(self._files):
                if file is not None:
                    fds.append(await file.open())
                    args[i] = Path(f"/proc/self/fd/{fds[-1]}")
        except BaseException:
            self.release()
            raise
        model, tokenizer, data = args
        assert model is not None
        return Launch(tuple(_argv(options, model, tokenizer, data)), tuple(fds))

    def release(self) -> None:
        """Close the descriptors (the worker that loaded them is gone)."""
        for file in self._files:
            if file is not None:
                file.release()

    def moved(self) -> str | None:
        """Why a file the running worker loaded is no longer the verified one, in words;
        ``None`` while they hold or nothing is open."""
        for file in self._files:
            moved = None if file is None else file.moved()
            if moved is not None:
                return moved
        return None


def _path(file: VerifiedFile | Path | None) -> Path | None:
    return file.path if isinstance(file, VerifiedFile) else file


def _argv(
    options: WorkerOptions, model: Path, tokenizer: Path | None, data: Path | None
) -> list[str]:
    """``options.argv`` with ``--onnx-data`` after it where the graph has a data file."""
    argv = options.argv(model, tokenizer)
    return argv if data is None else [*argv, "--onnx-data", str(data)]


def _close_opened(opening: asyncio.Future[tuple[int, VerifiedFile]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        with contextlib.suppress(OSError):
            os.close(opening.result()[0])

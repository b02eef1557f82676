"""The bytes a worker loads are the bytes that were verified.

A scan verifies a branch's file (sha256, signature, GGUF header) by its path;
a worker starts later — at the gateway's start, after a crash, on an
operator's restart, when residency loads it again, after a reload. What the
path names may have changed in between: a rename put another file there, or
the file was rewritten in place (and its mtime set back). So nothing loads a
path. Immediately before every spawn the gateway opens the file, and
:meth:`VerifiedFile.open` checks the open descriptor's identity (device,
inode, size, mtime, ctime: ``registry.digests.identity``) against the one the
verification read; where it differs — or where the verification read the file
within :data:`~quantroute.registry.digests.RACY_S` of its last change, when
timestamps alone prove nothing — it reads the descriptor's bytes again and
compares their sha256 with the verified one. The worker then loads that
descriptor (``/proc/self/fd/N``, passed to it open), so a rename after the
check cannot swap the file. Once the worker has loaded it, and at every
reload, :meth:`VerifiedFile.moved` compares the descriptor's identity again:
a file rewritten in place under a running worker is found there.

The residual window, stated: an in-place rewrite that keeps size, mtime and
ctime (only possible within one clock tick of the verification read, the case
the re-read above covers at spawn); a rewrite of a file a running worker has
mapped (llama.cpp maps its weights: the worker may compute with the new bytes
until the next reload or watch event finds the move and fails the branch); and,
for a running worker only, a rewrite that keeps size and mtime of a file whose
link count changed too (a rename over its name unlinks it, which moves its
ctime by itself; such an unlinked file is never opened again, and a writer
needs it open from before the rename).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from quantroute.errors import ArtifactIntegrityError
from quantroute.registry.digests import Identity, identity, open_regular, settled, sha256_fd

RELOAD_WORDS = "a reload will verify the new one"


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """A branch's file as its verification saw it. ``label`` names it in failure texts
    (relative to its model folder: never an absolute path, never a digest)."""

    path: Path
    label: str
    sha256: str
    identity: Identity
    settled: bool  # it had been still for RACY_S when read: its identity proves its bytes
    links: int = 0  # its link count when opened for a worker (0: not yet opened)

    def open(self) -> tuple[int, VerifiedFile]:
        """Open the file for a worker (blocking: it may read the whole file; call it in a
        thread) and prove that the descriptor holds the verified bytes. Returns the
        descriptor (close-on-exec; the caller passes it to the worker and closes it) and
        the record to keep (its identity now, when the bytes had to be read again).
        Raises :class:`ArtifactIntegrityError`, in words, for any other bytes."""
        try:
            fd = open_regular(self.path)  # a FIFO or a device there would hold the thread
        except OSError as exc:
            raise ArtifactIntegrityError(
                f"its file {self.label} cannot be opened ({exc.strerror}); {RELOAD_WORDS}"
            ) from exc
        try:
            st = os.fstat(fd)
            now = identity(st)
            if now == self.identity and self.settled:
                return fd, replace(self, links=st.st_nlink)
            if st.st_size != self.identity[2]:  # other bytes, whatever they hash to
                raise ArtifactIntegrityError(
                    f"its file {self.label} changed on disk since it was verified (it no "
                    f"longer has the verified size); {RELOAD_WORDS}"
                )
            started = time.time_ns()
            digest = sha256_fd(fd)
            st = os.fstat(fd)
            if identity(st) != now:
                raise ArtifactIntegrityError(
                    f"its file {self.label} changed while it was checked before loading; "
                    f"{RELOAD_WORDS}"
                )
            if digest != self.sha256:
                raise ArtifactIntegrityError(
                    f"its file {self.label} changed on disk since it was verified (it no "
                    f"longer matches the manifest's sha256); {RELOAD_WORDS}"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, replace(self, identity=now, settled=settled(st, started), links=st.st_nlink)

    def moved(self, fd: int) -> str | None:
        """Why the file open as ``fd`` (from :meth:`open`) is no longer what was verified,
        in words; ``None`` while its identity holds."""
        try:
            st = os.fstat(fd)
        except OSError:
            return f"its file {self.label} can no longer be read"
        now = identity(st)
        if now != self.identity and not self._relinked(st):
            return (
                f"its file {self.label} changed on disk after it was verified and loaded; "
                f"{RELOAD_WORDS}"
            )
        return None

    def _relinked(self, st: os.stat_result) -> bool:
        """Renamed over: its last name is gone (no link left), which moves ctime, not the
        bytes, and nobody can open it to write any more. Size and mtime must still hold.
        A link added (``ln``) is no excuse: whoever can add one can write the file too."""
        return bool(self.links) and st.st_nlink == 0 and identity(st)[:4] == self.identity[:4]

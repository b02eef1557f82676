"""Files' sha256s: read once per scan, and not again while a file is unchanged.

A scan verifies a model twice over: its signature (``model-signing`` hashes
every signed file) and its manifest (each branch's declared sha256). Both ask
one :class:`Digests`, so a scan reads each file once. The gateway keeps its
``Digests`` across reloads, and a later scan trusts a digest it already has
when the file's identity is the one that was read: the same device, inode,
size, mtime and ctime (nanoseconds). A rename over the file is a new inode; a
write into it moves mtime and ctime; ``touch -d`` can set mtime back but not
ctime, which only the kernel sets.

The one gap is the timestamps' granularity (a write in the same clock tick as
the read leaves them alone): like git's "racy" index entries, a digest read
while the file had changed in the last :data:`RACY_S` seconds serves only the
scan that read it; the next scan reads the file again, and trusts that digest
once the file has been still for ``RACY_S`` when read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RACY_S = 2.0  # a file changed this recently may change again with the same timestamps


def open_regular(path: Path | str) -> int:
    """``path`` open for reading (close-on-exec), when it is a regular file: a name
    swapped for a FIFO would block the opening thread for ever, a device (``/dev/zero``)
    would be hashed for ever. Raises :class:`NotRegularFileError` (an ``OSError``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO opens at once
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class NotRegularFileError(OSError):
    """A model file's name holds something else than a regular file."""


def sha256_file(path: Path, chunk_bytes: int = 4 << 20) -> str:
    """The file's sha256, streamed (a few MiB in memory, whatever its size); a regular
    file only (:func:`open_regular`)."""
    fd = open_regular(path)
    try:
        return sha256_fd(fd, chunk_bytes)
    finally:
        os.close(fd)


def sha256_fd(fd: int, chunk_bytes: int = 4 << 20) -> str:
    """The sha256 of the file open as ``fd``, read with ``pread`` (its offset untouched):
    the bytes of that inode, whatever name the path has meanwhile."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, chunk_bytes, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


Identity = tuple[int, int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    """What changes whenever a file's bytes may have: device, inode, size, mtime, ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(st: os.stat_result, read_at_ns: int) -> bool:
    """Whether a read that started at ``read_at_ns`` saw a file still for :data:`RACY_S`:
    then a later write moves its mtime or ctime, and its identity alone tells."""
    return read_at_ns - max(st.st_mtime_ns, st.st_ctime_ns) >= RACY_S * 1e9


@dataclass(frozen=True, slots=True)
class Checked:
    """One file's sha256 and the identity it had while read; ``settled``: see
    :func:`settled`. ``identity`` is ``None`` when the file changed while it was read
    (the digest is then of no one version of it)."""

    sha256: str
    identity: Identity | None
    settled: bool


@dataclass(frozen=True, slots=True)
class _Known:
    identity: Identity
    sha256: str
    settled: bool  # the file had been still for RACY_S when it was read
    scan: int


class Digests:
    """sha256s by file (thread-safe: ``model-signing`` hashes in threads)."""

    def __init__(self) -> None:
        self._known: dict[Path, _Known] = {}
        self._scan = 0
        self._lock = threading.Lock()
        self.reads = 0  # files read whole (the rest were known)

    def begin(self) -> None:
        """A new scan: digests of files not yet settled are read again."""
        with self._lock:
            self._scan += 1
            self._known = {p: k for p, k in self._known.items() if k.settled}

    def sha256(self, path: Path) -> str:
        return self.check(path).sha256

    def check(self, path: Path) -> Checked:
        """``path``'s sha256 with the identity the file had while it was read."""
        path = Path(path).resolve()
        before = path.stat()
        key = identity(before)
        with self._lock:
            known = self._known.get(path)
            fresh = known is not None and (known.settled or known.scan == self._scan)
            if known is not None and fresh and known.identity == key:
                return Checked(known.sha256, key, known.settled)
        started = time.time_ns()
        digest = sha256_file(path)
        after = identity(path.stat())
        with self._lock:
            self.reads += 1
            if after != key:  # changed while it was read
                return Checked(digest, None, False)
            still = settled(before, started)
            self._known[path] = _Known(key, digest, still, self._scan)
        return Checked(digest, key, still)

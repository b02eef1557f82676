"""registry.digests on real files: each file is read once a scan, and a later scan reads
it again exactly when it may have changed (a rename, a write, a touch, too recent)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from quantroute.registry import digests as digests_module
from quantroute.registry.digests import Digests, NotRegularFileError, sha256_file


@pytest.fixture
def settled_fast(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(digests_module, "RACY_S", 0.05)
    return 0.1  # how long to wait for a change to settle


def test_a_scan_reads_a_file_once_and_a_settled_file_is_not_read_again(
    tmp_path: Path, settled_fast: float
) -> None:
    path = tmp_path / "a.gguf"
    path.write_bytes(b"x" * 1000)
    time.sleep(settled_fast)
    d = Digests()
    d.begin()
    assert d.sha256(path) == d.sha256(tmp_path / "." / "a.gguf") == sha256_file(path)
    assert d.reads == 1
    d.begin()
    assert d.sha256(path) == sha256_file(path) and d.reads == 1


def test_a_file_changed_moments_before_it_was_read_is_read_again_next_scan(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.gguf"
    path.write_bytes(b"x" * 1000)
    d = Digests()
    d.begin()
    d.sha256(path)
    d.sha256(path)
    assert d.reads == 1  # one scan: one read
    d.begin()
    d.sha256(path)
    assert d.reads == 2  # within RACY_S of its last change: not trusted across scans


@pytest.mark.parametrize("change", ["rename", "write", "touch_back"])
def test_any_change_to_a_file_makes_the_next_scan_read_it(
    tmp_path: Path, settled_fast: float, change: str
) -> None:
    path = tmp_path / "a.gguf"
    path.write_bytes(b"x" * 1000)
    before = path.stat()
    time.sleep(settled_fast)
    d = Digests()
    d.begin()
    old = d.sha256(path)
    if change == "rename":
        (tmp_path / "a.tmp").write_bytes(b"y" * 1000)
        (tmp_path / "a.tmp").replace(path)
    elif change == "write":  # in place, the same size
        with path.open("r+b") as fh:
            fh.write(b"y")
    else:  # other bytes, then the mtime set back to what was read: ctime still moves
        with path.open("r+b") as fh:
            fh.write(b"z")
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_mtime_ns == before.st_mtime_ns
    d.begin()
    new = d.sha256(path)
    assert d.reads == 2 and new == sha256_file(path) and new != old


def test_only_a_regular_file_is_hashed(tmp_path: Path) -> None:
    """A FIFO would block the reading thread for ever, a device feed it for ever: both
    are refused at once, before a byte is read (the scan fails that branch)."""
    fifo = tmp_path / "swapped.gguf"
    os.mkfifo(fifo)
    start = time.monotonic()
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(NotRegularFileError):
            sha256_file(path)
        with pytest.raises(OSError, match="not a regular file"):
            Digests().check(path)
    assert time.monotonic() - start < 1

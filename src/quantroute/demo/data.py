"""Training text every machine has: the Python standard library's own sources.

The file list is sorted, then shuffled with a seeded generator so that a byte
cap keeps a spread of modules rather than the alphabetically first ones. Test
suites, vendored site-packages, generated tables and very large files are
skipped. Same Python, same seed, same cap: same corpus, byte for byte.
"""

from __future__ import annotations

import logging
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from quantroute.demo.vocab import VOCAB, ByteVocab

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 6_000_000
DEFAULT_MAX_FILE_BYTES = 150_000

# Folders whose sources are not representative Python (tests, third-party
# packages, codec tables, IDLE's test suite, pydoc's topic dump).
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "encodings",
        "pydoc_data",
    }
)


@dataclass(frozen=True, slots=True)
class Corpus:
    """The training corpus as one token stream.

    ``tokens`` is every selected file as ``<s> text </s>``, concatenated, in
    selection order; ``files`` are the paths, relative to ``root``.
    """

    root: Path
    files: tuple[str, ...]
    tokens: npt.NDArray[np.int32]  # [N]
    n_bytes: int

    @property
    def n_tokens(self) -> int:
        """Length of the token stream."""
        return int(self.tokens.shape[0])


def stdlib_root() -> Path:
    """The folder holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[Path]:
    """Every usable ``.py`` file under ``root``, sorted by relative path."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("test_") for part in rel.parts):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size <= max_file_bytes and path.is_file():
            found.append(rel)
    return [root / rel for rel in sorted(found, key=lambda p: p.as_posix())]


@dataclass(frozen=True, slots=True)
class Source:
    """One selected source file: its path relative to the corpus root, and its text."""

    path: str
    text: str


def select_sources(
    *, seed: int = 0, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None
) -> list[Source]:
    """The standard library sources a corpus is made of, in selection order.

    Files are taken in a seeded shuffle of the sorted list until ``max_bytes``
    of text is gathered; files that are not UTF-8 are skipped; CRLF becomes LF
    and tabs 4 spaces. Raises ``FileNotFoundError`` when no source is found (a
    Python without its standard library sources).
    """
    base = root or stdlib_root()
    paths = list_sources(base)
    random.Random(seed).shuffle(paths)
    chosen: list[Source] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n").replace("\t", "    ")
        if not text.strip():
            continue
        chosen.append(Source(path.relative_to(base).as_posix(), text))
        total += len(text.encode("utf-8"))
    if not chosen:
        raise FileNotFoundError(f"no Python sources found under {base}")
    return chosen


def load_corpus(
    *,
    seed: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    root: Path | None = None,
    vocab: ByteVocab = VOCAB,
) -> Corpus:
    """Read, select (:func:`select_sources`) and tokenize the standard library sources.

    Raises ``FileNotFoundError`` when no source is found.
    """
    base = root or stdlib_root()
    sources = select_sources(seed=seed, max_bytes=max_bytes, root=base)
    pieces = [vocab.encode_array(s.text, add_bos=True, add_eos=True) for s in sources]
    total = sum(len(s.text.encode("utf-8")) for s in sources)
    tokens = np.concatenate(pieces)
    logger.info(
        "corpus: %d files, %.1f MB, %d tokens from %s", len(sources), total / 1e6, len(tokens), base
    )
    return Corpus(root=base, files=tuple(s.path for s in sources), tokens=tokens, n_bytes=total)

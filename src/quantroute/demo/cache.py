"""Demo models too large for git, built once into a cache and reused.

:func:`ensure_demo_repo` returns a model repository (a folder holding
``<name>/quantroute.yaml`` and its files) for any demo model. tiny-llama is
packaged; ``stdlib-bpe-llama`` is built on first use into::

    <cache root>/<name>-<key>/<name>/     quantroute.yaml, *.gguf, tokenizer.json, profile.json
    <cache root>/<name>-<key>/build.json  the key's inputs, the build's time and date

``<key>`` is the first 16 hex digits of the sha256 of every input that decides
the built bytes (:func:`cache_key`): the build config, the seed, the code of
the demo modules a build runs (docstrings and comments aside), the corpus (the
exact text of every selected standard library source, so the Python version
too), the calibration text, and the versions of torch, tokenizers,
llama-cpp-python, gguf and numpy. Change any and the next call builds a new
folder beside the old one; change none and it is reused. A build happens in
a temporary folder renamed into place, under a lock, so concurrent callers
build once and never see half a model. The profiler's code is not in the key:
after changing it, run ``quantroute profile`` on the folder.

>>> repo = ensure_demo_repo("stdlib-bpe-llama")  # doctest: +SKIP
>>> # quantroute serve --repo {repo}
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from quantroute.demo.bpe_builder import BPE_MODEL_NAME, BpeBuildConfig, build_bpe_demo
from quantroute.demo.builder import DEFAULT_REPO_DIR, MODEL_NAME
from quantroute.demo.data import select_sources
from quantroute.errors import ArtifactIntegrityError, ManifestError, NotFoundError
from quantroute.registry.manifest import MANIFEST_NAME, load_manifest, verify_artifacts

logger = logging.getLogger(__name__)

DEMO_MODELS: tuple[str, ...] = (MODEL_NAME, BPE_MODEL_NAME)
"""Every demo model :func:`ensure_demo_repo` knows, the packaged one first."""

BUILD_INFO = "build.json"
# Every module a build runs (this one only names the folder, and __init__ only re-exports).
_BUILD_MODULES = (
    "bpe.py",
    "bpe_builder.py",
    "builder.py",
    "chats.py",
    "data.py",
    "gguf_export.py",
    "model.py",
    "train_process.py",
    "train_worker.py",
    "vocab.py",
)
_KEYED_PACKAGES = ("torch", "tokenizers", "llama_cpp_python", "gguf", "numpy")


def default_cache_root() -> Path:
    """``~/.cache/quantroute/demo``: where built demo models live unless told otherwise."""
    return Path.home() / ".cache" / "quantroute" / "demo"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """A build's identity: ``digest`` is the sha256 of ``inputs`` (canonical JSON)."""

    name: str
    digest: str  # 64 hex digits
    inputs: Mapping[str, Any]

    @property
    def folder(self) -> str:
        """The cache folder's name: ``<name>-<first 16 hex digits>``."""
        return f"{self.name}-{self.digest[:16]}"


def code_version() -> str:
    """sha256 over the code of the demo modules that decide a build's bytes.

    Each module counts as its syntax tree without docstrings
    (:func:`code_digest`), so editing a comment or a docstring does not
    rebuild an 80 MB model.
    """
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _BUILD_MODULES:
        source = (here / name).read_text(encoding="utf-8")
        digest.update(name.encode() + b"\0" + code_digest(source).encode() + b"\0")
    return digest.hexdigest()


def code_digest(source: str) -> str:
    """sha256 of Python ``source``'s syntax tree, docstrings and comments left out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def corpus_fingerprint(*, seed: int, max_bytes: int) -> str:
    """sha256 over the selected sources' paths and text, in selection order."""
    digest = hashlib.sha256()
    for source in select_sources(seed=seed, max_bytes=max_bytes):
        digest.update(source.path.encode() + b"\0" + source.text.encode() + b"\0")
    return digest.hexdigest()


def _calibration_sha256() -> str:
    from quantroute.quality.profiler import default_calibration_text

    return hashlib.sha256(default_calibration_text().encode()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def cache_key(name: str, config: BpeBuildConfig, seed: int) -> CacheKey:
    """The key of building demo model ``name`` with ``config`` and ``seed`` here."""
    inputs: dict[str, Any] = {
        "name": name,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "code": code_version(),
        "corpus": corpus_fingerprint(seed=seed, max_bytes=config.max_corpus_bytes),
        "calibration": _calibration_sha256(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in _KEYED_PACKAGES},
    }
    canonical = json.dumps(inputs, sort_keys=True, default=str, separators=(",", ":"))
    inputs = json.loads(canonical)  # what is hashed is what build.json records
    return CacheKey(name, hashlib.sha256(canonical.encode()).hexdigest(), inputs)


def ensure_demo_repo(
    name: str = BPE_MODEL_NAME,
    *,
    cache_root: Path | None = None,
    config: BpeBuildConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    rebuild: bool = False,
) -> Path:
    """The model repository holding demo model ``name`` (``<repo>/<name>/``), built if need be.

    ``tiny-llama`` is the packaged repository (``config``, ``seed`` and
    ``rebuild`` do not apply to it). Any other demo model is looked up in
    ``cache_root`` (default :func:`default_cache_root`) under its
    :func:`cache_key`, and built there when absent, damaged (a file that
    fails its sha256) or ``rebuild`` is set. Raises ``NotFoundError`` for a
    name that is not a demo model.
    """
    if name == MODEL_NAME:
        if config is not None or rebuild:
            raise ValueError("tiny-llama is packaged: build it with `quantroute demo build`")
        return DEFAULT_REPO_DIR.parent
    if name != BPE_MODEL_NAME:
        raise NotFoundError(f"no demo model {name!r}; choose from {', '.join(DEMO_MODELS)}")
    cfg = config or BpeBuildConfig()
    root = cache_root or default_cache_root()
    key = cache_key(name, cfg, seed)
    repo = root / key.folder
    if not rebuild and _is_sound(repo / name):
        logger.info("%s: reusing %s", name, repo)
        return repo
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{key.folder}.lock"):
        if not rebuild and _is_sound(repo / name):  # another process built it meanwhile
            return repo
        for stale in root.glob(f".{key.folder}.*"):  # a build that was killed; ours now
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("%s: building into %s (key %s)", name, repo, key.digest[:16])
        _build_into(repo, key, cfg, seed=seed, progress=progress)
    return repo


def _is_sound(model_dir: Path) -> bool:
    if not (model_dir / MANIFEST_NAME).is_file():
        return False
    try:
        verify_artifacts(model_dir, load_manifest(model_dir))
    except (ManifestError, ArtifactIntegrityError) as exc:
        logger.warning("%s is damaged (%s); building it again", model_dir, exc.message)
        return False
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_into(
    repo: Path, key: CacheKey, config: BpeBuildConfig, *, seed: int, progress: bool
) -> None:
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix=f".{key.folder}.", dir=repo.parent))
    try:
        build_bpe_demo(scratch / key.name, config=config, seed=seed, progress=progress)
        info = {
            "key": key.digest,
            "inputs": key.inputs,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        }
        (scratch / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        scratch.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        if repo.exists():  # damaged, or a rebuild: set the old one aside first
            shutil.rmtree(repo)
        os.replace(scratch, repo)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("%s: built %s in %.0f s", key.name, repo, time.monotonic() - started)

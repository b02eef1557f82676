"""A model repository on disk: one folder per model, each with its manifest.

A model whose manifest is bad is reported and left out; a branch whose file is
missing, does not match its sha256 or has a corrupt header is kept, marked
with its problem (it is failed and never started); neither stops the others
from serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from quantroute.errors import ConfigError, ManifestError
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchArtifact,
    Manifest,
    check_artifacts,
    load_manifest,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    directory: Path
    manifest: Manifest
    artifacts: tuple[BranchArtifact, ...]  # reference first


@dataclass(frozen=True, slots=True)
class RepositoryScan:
    models: tuple[ModelEntry, ...]
    problems: tuple[str, ...]  # one line per model left out


def model_dirs(repo: Path) -> list[Path]:
    """Model folders under ``repo``; ``repo`` itself when it holds a manifest."""
    if not repo.is_dir():
        raise ConfigError(f"model repository {repo} is not a directory")
    if (repo / MANIFEST_NAME).is_file():
        return [repo]
    return sorted(p for p in repo.iterdir() if (p / MANIFEST_NAME).is_file())


def scan_repository(repo: Path) -> RepositoryScan:
    models: list[ModelEntry] = []
    problems: list[str] = []
    seen: set[str] = set()
    for directory in model_dirs(repo):
        try:
            manifest = load_manifest(directory)
            if manifest.model in seen:
                raise ManifestError(f"model {manifest.model} is declared twice")
            artifacts = check_artifacts(directory, manifest)
        except ManifestError as exc:
            log.error("left out %s: %s", directory.name, exc.message)
            problems.append(exc.message)
            continue
        seen.add(manifest.model)
        for artifact in artifacts:
            if artifact.problem is not None:
                log.error("branch failed: %s", artifact.problem)
        models.append(ModelEntry(directory, manifest, tuple(artifacts)))
    return RepositoryScan(tuple(models), tuple(problems))

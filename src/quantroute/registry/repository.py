"""A model repository on disk: one folder per model, each with its manifest.

A model whose manifest is bad is reported and left out; a branch whose file is
missing, does not match its sha256 or has a corrupt header is kept, marked
with its problem (it is failed and never started); neither stops the others
from serving.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from quantroute.errors import ArtifactIntegrityError, ConfigError, ManifestError
from quantroute.registry.branch import EngineRules
from quantroute.registry.digests import Digests
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchArtifact,
    Manifest,
    check_versions,
    parse_manifest,
    read_manifest,
)
from quantroute.registry.signing import TrustPolicy, verify_model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    directory: Path
    manifest: Manifest
    artifacts: tuple[BranchArtifact, ...]  # the top-level version's, reference first
    versions: tuple[tuple[BranchArtifact, ...], ...] = ()  # every version's, top-level first
    signature: str | None = None  # how its signature was checked ("verified by ..."), if it was
    # the files its signature verified (relative path -> sha256); empty when unsigned
    signed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RepositoryScan:
    models: tuple[ModelEntry, ...]
    problems: tuple[str, ...]  # one line per model left out
    failed: tuple[Path, ...] = ()  # the folders of the models left out


def model_dirs(repo: Path) -> list[Path]:
    """Model folders under ``repo``; ``repo`` itself when it holds a manifest."""
    if not repo.is_dir():
        raise ConfigError(f"model repository {repo} is not a directory")
    if (repo / MANIFEST_NAME).is_file():
        return [repo]
    return sorted(p for p in repo.iterdir() if (p / MANIFEST_NAME).is_file())


def scan_repository(
    repo: Path,
    trust: TrustPolicy | None = None,
    *,
    isolated: bool = True,
    timeout_s: float | None = None,
    memory_bytes: int | None = None,
    digests: Digests | None = None,
    follow_links: bool = False,
    engines: Mapping[str, EngineRules] | None = None,
) -> RepositoryScan:
    """Every model of ``repo``: its manifest validated, its signature verified under
    ``trust``, every version's files checked (sha256, then the GGUF header in a
    bounded child process unless ``isolated`` is false). Each file is read once
    (``digests``, kept across scans by a caller that scans again: ``registry.digests``).
    ``follow_links``: a branch's file may resolve outside its model folder. ``engines``:
    the engine table each branch's ``engine`` must name (``engines.table.ENGINES``)."""
    digests = digests or Digests()
    digests.begin()
    models: list[ModelEntry] = []
    problems: list[str] = []
    failed: list[Path] = []
    seen: set[str] = set()
    for directory in model_dirs(repo):
        try:
            entry = scan_model(
                directory,
                trust,
                isolated=isolated,
                timeout_s=timeout_s,
                memory_bytes=memory_bytes,
                digests=digests,
                follow_links=follow_links,
                engines=engines,
            )
            if entry.manifest.model in seen:
                raise ManifestError(f"model {entry.manifest.model} is declared twice")
        except ManifestError as exc:
            log.error("left out %s: %s", directory.name, exc.message)
            problems.append(exc.message)
            failed.append(directory)
            continue
        seen.add(entry.manifest.model)
        for artifact in (a for version in entry.versions for a in version):
            if artifact.problem is not None:
                log.error("branch failed: %s", artifact.problem)
        models.append(entry)
    return RepositoryScan(tuple(models), tuple(problems), tuple(failed))


def scan_model(
    directory: Path,
    trust: TrustPolicy | None = None,
    *,
    isolated: bool = True,
    timeout_s: float | None = None,
    memory_bytes: int | None = None,
    digests: Digests | None = None,
    follow_links: bool = False,
    engines: Mapping[str, EngineRules] | None = None,
) -> ModelEntry:
    """One model folder, as :func:`scan_repository` checks it; raises
    :class:`ManifestError` (or its :class:`ArtifactIntegrityError`) for a bad manifest
    or signature; a bad file is its branch's ``problem``. A signed model's manifest is
    parsed from the very bytes its signature verified (a manifest swapped between the
    read and the check is refused)."""
    data = read_manifest(directory)
    manifest = parse_manifest(directory, data, engines)
    digests = digests or Digests()
    signed: dict[str, str] = {}
    signature = verify_model(directory, trust or TrustPolicy(), digests, signed=signed)
    if signature is not None and signed.get(MANIFEST_NAME) != hashlib.sha256(data).hexdigest():
        raise ArtifactIntegrityError(
            f"{directory.name}: {MANIFEST_NAME} changed while it was being verified, or its "
            "signature does not cover it"
        )
    versions = check_versions(
        directory,
        manifest,
        isolated=isolated,
        timeout_s=timeout_s,
        memory_bytes=memory_bytes,
        digests=digests,
        follow_links=follow_links,
    )
    return ModelEntry(
        directory,
        manifest,
        tuple(versions[0]),
        tuple(map(tuple, versions)),
        signature,
        signed if signature is not None else {},
    )

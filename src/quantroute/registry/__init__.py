"""Model repositories: manifests, artifact verification, scanning."""

from __future__ import annotations

from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchArtifact,
    BranchSpec,
    Manifest,
    load_manifest,
    sha256_file,
    verify_artifacts,
    write_manifest,
)
from quantroute.registry.repository import ModelEntry, RepositoryScan, scan_repository

__all__ = [
    "MANIFEST_NAME",
    "BranchArtifact",
    "BranchSpec",
    "Manifest",
    "ModelEntry",
    "RepositoryScan",
    "load_manifest",
    "scan_repository",
    "sha256_file",
    "verify_artifacts",
    "write_manifest",
]

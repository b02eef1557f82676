"""Model repositories: manifests, artifact verification, scanning."""

from __future__ import annotations

from quantroute.registry.gguf_check import GgufSummary, check_gguf
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchArtifact,
    BranchSpec,
    Manifest,
    check_artifacts,
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
    "GgufSummary",
    "Manifest",
    "ModelEntry",
    "RepositoryScan",
    "check_artifacts",
    "check_gguf",
    "load_manifest",
    "scan_repository",
    "sha256_file",
    "verify_artifacts",
    "write_manifest",
]

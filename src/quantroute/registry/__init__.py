"""Model repositories: manifests, artifact verification (GGUF headers; an ONNX branch's
graph and tokenizer), signatures, scanning, watching, and the verified file a worker is
handed (``verified``)."""

from __future__ import annotations

from quantroute.registry.branch import (
    BranchSpec,
    DeclaredProfile,
    EngineOptions,
    EngineRules,
    RemoteOptions,
    TokenizerFile,
)
from quantroute.registry.digests import Digests
from quantroute.registry.gguf_check import GgufSummary, check_gguf, check_gguf_isolated
from quantroute.registry.manifest import (
    MANIFEST_NAME,
    BranchArtifact,
    Manifest,
    TrafficRule,
    VersionSpec,
    check_artifacts,
    check_versions,
    load_manifest,
    sha256_file,
    verify_artifacts,
    write_manifest,
)
from quantroute.registry.onnx_check import OnnxSummary, check_onnx
from quantroute.registry.onnx_pair import check_onnx_isolated, read_onnx_isolated
from quantroute.registry.repository import ModelEntry, RepositoryScan, scan_model, scan_repository
from quantroute.registry.signing import SIGNATURE_NAME, TrustPolicy, sign_model, verify_model
from quantroute.registry.verified import VerifiedFile
from quantroute.registry.watcher import is_temporary, watch_repository

__all__ = [
    "MANIFEST_NAME",
    "SIGNATURE_NAME",
    "BranchArtifact",
    "BranchSpec",
    "DeclaredProfile",
    "Digests",
    "EngineOptions",
    "EngineRules",
    "GgufSummary",
    "Manifest",
    "ModelEntry",
    "OnnxSummary",
    "RemoteOptions",
    "RepositoryScan",
    "TokenizerFile",
    "TrafficRule",
    "TrustPolicy",
    "VerifiedFile",
    "VersionSpec",
    "check_artifacts",
    "check_gguf",
    "check_gguf_isolated",
    "check_onnx",
    "check_onnx_isolated",
    "check_versions",
    "is_temporary",
    "load_manifest",
    "read_onnx_isolated",
    "scan_model",
    "scan_repository",
    "sha256_file",
    "sign_model",
    "verify_artifacts",
    "verify_model",
    "watch_repository",
    "write_manifest",
]

"""``profile.json``: what was measured about each branch, keyed by its file's sha256.

Written beside a model's ``quantroute.yaml`` by ``quantroute profile``::

    {
      "version": 1,
      "model": "tiny-llama",
      "reference": {"branch": "f16", "sha256": "9f2c..."},
      "method": {"calibration_sha256": "...", "n_ctx": 256, "n_chunks": 40,
                 "n_scored_tokens": 5080, "reference_branch": "f16",
                 "tool": "quantroute profile", "llama_cpp_version": "0.3.36", ...},
      "branches": {
        "41d0...": {"branch": "q8_0", "precision": "q8_0",
                    "quality": {"mean_kld": 0.0007, "kld_p99": 0.006, "top1": 0.975, ...},
                    "footprint": {"file_bytes": ..., "rss_bytes": ...},
                    "speed": {"prefill_tps": ..., "decode_tps": ...},
                    "measured_at": "2026-11-29T18:05:00Z"}
      }
    }

A profile describes one exact file: when a branch's file changes (its sha256
no longer matches), its profile is stale and :func:`load_profiles` drops it
with a warning; when the reference's file changes, every quality number was
measured against something else, and all of them are dropped.

Under ``repository.require_signatures`` a profile counts only if the model's
signature covers ``profile.json`` (profile, then sign: ``registry.signing``)
and the bytes read are the ones it verified (``Trust``); otherwise it is
ignored, with a warning, and the model routes as if unprofiled.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantroute.quality.metrics import QualityStats
from quantroute.registry.manifest import BranchArtifact
from quantroute.types import Precision

PROFILE_NAME = "profile.json"
PROFILE_VERSION: Literal[1] = 1
TOOL = "quantroute profile"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class ProfileMethod:
    """How a profile was measured: enough to tell whether two profiles compare."""

    calibration_sha256: str
    n_ctx: int
    n_chunks: int
    n_scored_tokens: int
    reference_branch: str
    llama_cpp_version: str
    n_threads: int
    decode_tokens: int
    tool: str = TOOL


@dataclass(frozen=True, slots=True)
class BranchProfile:
    """One branch's measured quality, footprint and speed, valid for the file ``sha256``."""

    model: str
    branch: str
    precision: Precision
    sha256: str
    quality: QualityStats
    file_bytes: int
    rss_bytes: int
    prefill_tps: float
    decode_tps: float
    measured_at: datetime

    @property
    def mean_kld(self) -> float:
        return self.quality.mean_kld

    @property
    def kld_p99(self) -> float:
        return self.quality.kld_p99

    @property
    def top1(self) -> float:
        return self.quality.top1


# ---- the file schema (pydantic: this is a file edge) ------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class ReferenceRecord(_Record):
    branch: str
    sha256: str


class FootprintRecord(_Record):
    file_bytes: int = Field(ge=0)
    rss_bytes: int = Field(ge=0, description="Resident memory added by loading and running it.")


class SpeedRecord(_Record):
    prefill_tps: float = Field(ge=0, description="Prompt tokens per second over one chunk.")
    decode_tps: float = Field(ge=0, description="Greedy generated tokens per second.")


class BranchRecord(_Record):
    branch: str
    precision: Precision
    quality: QualityStats
    footprint: FootprintRecord
    speed: SpeedRecord
    measured_at: datetime


class ProfileFile(_Record):
    """The whole ``profile.json``; ``branches`` is keyed by each file's sha256."""

    version: Literal[1] = PROFILE_VERSION
    model: str
    reference: ReferenceRecord
    method: ProfileMethod
    branches: dict[str, BranchRecord]

    @field_validator("branches")
    @classmethod
    def _sha_keys(cls, value: dict[str, BranchRecord]) -> dict[str, BranchRecord]:
        for key in value:
            if not _SHA256.match(key):
                raise ValueError(f"branch key {key[:16]!r} is not a sha256")
        return value


# ---- reading and writing ----------------------------------------------------------------------


def to_file(
    model: str, reference: BranchArtifact, method: ProfileMethod, profiles: Sequence[BranchProfile]
) -> ProfileFile:
    """The file record for ``profiles`` (one per branch, the reference among them)."""
    return ProfileFile(
        model=model,
        reference=ReferenceRecord(branch=reference.name, sha256=reference.sha256),
        method=method,
        branches={
            p.sha256: BranchRecord(
                branch=p.branch,
                precision=p.precision,
                quality=p.quality,
                footprint=FootprintRecord(file_bytes=p.file_bytes, rss_bytes=p.rss_bytes),
                speed=SpeedRecord(prefill_tps=p.prefill_tps, decode_tps=p.decode_tps),
                measured_at=p.measured_at,
            )
            for p in profiles
        },
    )


def write_profile(model_dir: Path, profile: ProfileFile) -> Path:
    """Write ``model_dir/profile.json`` atomically: a reader sees old or new, never half."""
    path = model_dir / PROFILE_NAME
    data = profile.model_dump_json(indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=model_dir)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the profile from the serving user
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True, slots=True)
class Trust:
    """Which ``profile.json`` may be used: with ``required`` (``require_signatures``),
    only one whose bytes have ``signed_sha256``, the digest the model's signature
    verified for it (``None``: the signature does not cover it)."""

    required: bool = False
    signed_sha256: str | None = None


class UnsignedProfileError(ValueError):
    """``profile.json`` is not the signed one, where signatures are required."""


def read_profile(model_dir: Path, trust: Trust | None = None) -> ProfileFile:
    """Parse ``model_dir/profile.json``: ``OSError`` or pydantic ``ValidationError`` if bad,
    :class:`UnsignedProfileError` if ``trust`` requires a signed one and it is not."""
    data = (model_dir / PROFILE_NAME).read_bytes()
    if trust is not None and trust.required:
        if trust.signed_sha256 is None:
            raise UnsignedProfileError("the model's signature does not cover it")
        if hashlib.sha256(data).hexdigest() != trust.signed_sha256:
            raise UnsignedProfileError("it changed after its signature was verified")
    return ProfileFile.model_validate_json(data)


def load_profiles(
    model_dir: Path, artifacts: Sequence[BranchArtifact], trust: Trust | None = None
) -> tuple[dict[str, BranchProfile | None], list[str]]:
    """Each verified branch's profile, or ``None`` where there is no valid one, and warnings.

    ``artifacts`` come from :func:`quantroute.registry.manifest.verify_artifacts`.
    A profile counts only for the exact file it measured: a branch whose
    sha256 is not in ``profile.json`` gets ``None`` (and a warning saying
    whether its file changed or it was never profiled). If the reference's
    file changed, or the file is missing or unreadable, every branch gets
    ``None``, and so does every branch when ``trust`` requires a signed profile
    and this one is not. Never raises for a bad profile: routing falls back to
    precision rank, and the warnings say why.
    """
    result: dict[str, BranchProfile | None] = {a.name: None for a in artifacts}
    if not artifacts:
        return result, []
    model = artifacts[0].model
    try:
        doc = read_profile(model_dir, trust)
    except FileNotFoundError:
        return result, [f"{model}: no {PROFILE_NAME}; run `quantroute profile` to measure it"]
    except UnsignedProfileError as exc:
        return result, [
            f"{model}: {PROFILE_NAME} is ignored: {exc} (repository.require_signatures); "
            "the model routes as if unprofiled until it is signed with the model"
        ]
    except (OSError, ValidationError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it does not match the schema"
        return result, [f"{model}: {PROFILE_NAME} is ignored: {reason}"]

    if doc.model != model:
        return result, [f"{model}: {PROFILE_NAME} describes model {doc.model!r}; ignored"]
    reference = next((a for a in artifacts if a.is_reference), None)
    if reference is not None and doc.reference.sha256 != reference.sha256:
        return result, [
            f"{model}: reference {reference.name} ({reference.path.name}) changed since it was "
            f"profiled (sha256 {reference.sha256[:12]}..., profiled {doc.reference.sha256[:12]}"
            "...); every quality profile of this model is stale: run `quantroute profile`"
        ]

    warnings: list[str] = []
    for art in artifacts:
        rec = doc.branches.get(art.sha256)
        if rec is None:
            old = next((k for k, r in doc.branches.items() if r.branch == art.name), None)
            if old is not None:
                warnings.append(
                    f"{model}:{art.name}: {art.path.name} changed since it was profiled "
                    f"(sha256 {art.sha256[:12]}..., profiled {old[:12]}...); its profile is "
                    "ignored until `quantroute profile` runs again"
                )
            else:
                warnings.append(f"{model}:{art.name}: not profiled yet")
            continue
        result[art.name] = BranchProfile(
            model=model,
            branch=art.name,
            precision=art.precision,
            sha256=art.sha256,
            quality=rec.quality,
            file_bytes=rec.footprint.file_bytes,
            rss_bytes=rec.footprint.rss_bytes,
            prefill_tps=rec.speed.prefill_tps,
            decode_tps=rec.speed.decode_tps,
            measured_at=rec.measured_at,
        )
    return result, warnings


def stale_profiles(
    model_dir: Path, artifacts: Sequence[BranchArtifact], trust: Trust | None = None
) -> frozenset[str]:
    """The branches whose profile measured another file than theirs (replaced since it
    was profiled; or, when the reference's file changed, every profiled branch). Such
    a branch is unprofiled (:func:`load_profiles` gives it ``None``) and reported
    *stale* until ``quantroute profile`` runs again."""
    try:
        doc = read_profile(model_dir, trust)
    except (OSError, ValidationError, ValueError):
        return frozenset()
    if not artifacts or doc.model != artifacts[0].model:
        return frozenset()
    profiled = {r.branch for r in doc.branches.values()}
    reference = next((a for a in artifacts if a.is_reference), None)
    if reference is not None and doc.reference.sha256 != reference.sha256:
        return frozenset(a.name for a in artifacts if a.name in profiled)
    return frozenset(
        a.name for a in artifacts if a.name in profiled and a.sha256 not in doc.branches
    )

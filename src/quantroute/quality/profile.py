"""``profile.json``: what was measured about each branch, keyed by its file's sha256.

Written beside a model's ``quantroute.yaml`` by ``quantroute profile``::

    {
      "version": 1,
      "model": "tiny-llama",
      "reference": {"branch": "f16", "sha256": "9f2c..."},
      "method": {"calibration_sha256": "...", "n_ctx": 256, "n_chunks": 40,
                 "n_scored_tokens": 5080, "reference_branch": "f16",
                 "tool": "quantroute profile", "llama_cpp_version": "0.3.36",
                 "onnxruntime_version": null, ...},
      "branches": {
        "41d0...": {"branch": "q8_0", "precision": "q8_0",
                    "quality": {"mean_kld": 0.0007, "kld_p99": 0.006, "top1": 0.975, ...},
                    "footprint": {"file_bytes": ..., "rss_bytes": ...},
                    "speed": {"prefill_tps": ..., "decode_tps": ...},
                    "measured_at": "2026-11-29T18:05:00Z"}
      }
    }

An ONNX Runtime branch (``engine: onnxruntime``) is keyed by its ``model.onnx``'s
sha256 like a GGUF branch by its file's, and measured the same way (``quality.runners``);
its ``tokenizer.gguf`` must tokenize as the reference does, which ``quantroute profile``
checks by vocabulary size.

A profile describes one exact file: when a branch's file changes (its sha256
no longer matches), its profile is stale and :func:`load_profiles` drops it
with a warning; when the reference's file changes, every quality number was
measured against something else, and all of them are dropped.

Under ``repository.require_signatures`` a profile counts only if the model's
signature covers ``profile.json`` (profile, then sign: ``registry.signing``)
and the bytes read are the ones it verified (``Trust``); otherwise it is
ignored, with a warning, and the model routes as if unprofiled.

A remote branch (``url``) has no file: its profile is keyed by :func:`remote_key`
of its endpoint and carries ``"fidelity": {"measure": "topk", ...}``, since it was
measured from the server's top-k log-probabilities (a lower bound of its KLD, see
``quality/remote.py``). A remote that gives no log-probabilities can only be
*declared*: the manifest states its numbers under the branch's ``profile:``, and
:func:`load_profiles` shows them with ``measure: declared``, never as measured.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantroute.errors import ConfigError, NotFoundError
from quantroute.quality.metrics import QualityStats
from quantroute.registry.branch import DeclaredProfile
from quantroute.registry.manifest import MANIFEST_NAME, BranchArtifact, load_manifest
from quantroute.types import Precision

logger = logging.getLogger(__name__)

PROFILE_NAME = "profile.json"
PROFILE_VERSION: Literal[1] = 1
TOOL = "quantroute profile"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class ProfileMethod:
    """How a profile was measured: enough to tell whether two profiles compare.

    ``llama_cpp_version`` is always set (the plan is tokenized by llama.cpp);
    ``onnxruntime_version`` only where ONNX Runtime branches were measured (``None``
    otherwise, and in files written before it existed).
    """

    calibration_sha256: str
    n_ctx: int
    n_chunks: int
    n_scored_tokens: int
    reference_branch: str
    llama_cpp_version: str
    n_threads: int
    decode_tokens: int
    tool: str = TOOL
    onnxruntime_version: str | None = None


class Measure(StrEnum):
    """How a branch's quality numbers were obtained."""

    FULL = "full"  # every token's probability, from the branch's logits (a local file)
    TOPK = "topk"  # a server's top-k log-probabilities: KLD is a lower bound
    DECLARED = "declared"  # stated in the manifest, never measured here


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How a branch's quality was measured, and what that leaves out.

    ``top_k``, ``tail_mass`` and ``dialect`` describe a :attr:`Measure.TOPK` profile:
    the tokens the branch listed per position (its own next token added where it was
    not among them), the mean reference mass outside them (what the KLD bound can
    miss), and how the server was asked (``quality.remote.Dialect``).
    """

    measure: Measure = Measure.FULL
    top_k: int = 0
    tail_mass: float = 0.0
    dialect: str = ""


FULL = Fidelity()


def remote_key(url: str, remote_model: str) -> str:
    """The key of a remote branch's profile: the sha256 of its endpoint, as a file's
    profile is keyed by the file's. A server can change its weights behind the same
    URL; the profile cannot see that, the drift monitor can."""
    return hashlib.sha256(f"quantroute-remote\0{url}\0{remote_model}".encode()).hexdigest()


def profile_key(artifact: BranchArtifact) -> str:
    """The key of ``artifact``'s profile in ``profile.json``: its file's sha256, or for a
    remote branch :func:`remote_key` of its URL and the model name it is asked for
    (``remote_model``, by default the branch's name)."""
    if artifact.url is None:
        return artifact.sha256
    remote_model = artifact.spec.remote_model if artifact.spec is not None else None
    return remote_key(artifact.url, remote_model or artifact.name)


@dataclass(frozen=True, slots=True)
class BranchProfile:
    """One branch's quality, footprint and speed, valid for the file ``sha256`` (for a
    remote branch, :func:`remote_key` of its endpoint). ``fidelity`` says how the
    quality was obtained: measured in full, from a server's top-k, or declared.
    Footprint and speed are 0 where unknown (a remote branch's)."""

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
    fidelity: Fidelity = FULL

    @property
    def measured(self) -> bool:
        """Whether quantroute measured the numbers (in full or from a top-k), not a manifest."""
        return self.fidelity.measure is not Measure.DECLARED

    @property
    def mean_kld(self) -> float:
        return self.quality.mean_kld

    @property
    def kld_p99(self) -> float:
        return self.quality.kld_p99

    @property
    def top1(self) -> float:
        return self.quality.top1


@dataclass(frozen=True, slots=True)
class ModelProfileResult:
    """One model's profile run: what was measured and where it was written."""

    model: str
    model_dir: Path
    profile_path: Path
    plot_path: Path | None
    method: ProfileMethod
    branches: tuple[BranchProfile, ...]  # reference first
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """Everything one ``profile_repo`` call profiled."""

    models: tuple[ModelProfileResult, ...]
    elapsed_s: float


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
    fidelity: Fidelity | None = Field(default=None, description="None: measured in full.")


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


# ---- model folders ------------------------------------------------------------------------------


def find_model_dirs(repo: Path | str, model: str | None = None) -> list[Path]:
    """Model folders under ``repo`` (or ``repo`` itself if it is one), optionally one ``model``.

    ``model`` matches the manifest's model name; while looking for it, folders
    whose manifest does not parse are skipped with a warning. Raises
    ``ConfigError`` if there is no ``quantroute.yaml`` to be found and
    ``NotFoundError`` if ``model`` names none of them.
    """
    repo = Path(repo)
    if (repo / MANIFEST_NAME).is_file():
        dirs = [repo]
    elif repo.is_dir():
        dirs = sorted(d for d in repo.iterdir() if (d / MANIFEST_NAME).is_file())
    else:
        dirs = []
    if not dirs:
        raise ConfigError(f"{repo} holds no model: no {MANIFEST_NAME} in it or its folders")
    if model is not None:
        dirs = [d for d in dirs if _model_name(d) == model]
        if not dirs:
            raise NotFoundError(f"model {model!r} is not in {repo}", param="model")
    return dirs


def _model_name(model_dir: Path) -> str | None:
    try:
        return load_manifest(model_dir).model
    except ConfigError as exc:
        logger.warning("skipping %s: %s", model_dir, exc)
        return None


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
                fidelity=None if p.fidelity == FULL else p.fidelity,
            )
            for p in profiles
            if p.measured
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

    A remote branch's measured profile is found by :func:`profile_key`; one without
    any, whose manifest declares a ``profile:``, gets that (``measure: declared``),
    whatever ``profile.json`` holds: the manifest is what states it (and what a
    signature covers).
    """
    result, warnings = _measured_profiles(model_dir, artifacts, trust)
    for art in artifacts:
        declared = art.spec.profile if art.spec is not None else None
        if result[art.name] is None and declared is not None:
            result[art.name] = declared_profile(art, declared)
    return result, warnings


def declared_profile(artifact: BranchArtifact, declared: DeclaredProfile) -> BranchProfile:
    """The profile a manifest states for ``artifact`` (its branch's ``profile:``): its
    ``mean_kld`` and ``top1``, and speeds if given (else 0, unknown). Every statistic it
    does not state is NaN, never a guess; ``n_tokens`` is 0 (nothing was scored) and
    ``measured_at`` the epoch (it never was)."""
    nan = math.nan
    quality = QualityStats(
        n_tokens=0,
        mean_kld=declared.mean_kld,
        kld_stderr=nan,
        kld_median=nan,
        kld_p90=nan,
        kld_p99=nan,
        kld_p999=nan,
        kld_max=nan,
        top1=declared.top1,
        top1_sigma=nan,
        ppl_q=nan,
        ppl_q_stderr=nan,
        ppl_ref=nan,
        ppl_ref_stderr=nan,
        ln_ppl_ratio=nan,
        ln_ppl_ratio_stderr=nan,
        mean_dp=nan,
        mean_dp_stderr=nan,
        rms_dp=nan,
        rms_dp_stderr=nan,
    )
    return BranchProfile(
        model=artifact.model,
        branch=artifact.name,
        precision=artifact.precision,
        sha256=profile_key(artifact),
        quality=quality,
        file_bytes=0,
        rss_bytes=0,
        prefill_tps=declared.prefill_tps or 0.0,
        decode_tps=declared.decode_tps or 0.0,
        measured_at=datetime.fromtimestamp(0, UTC),
        fidelity=Fidelity(measure=Measure.DECLARED),
    )


def _declares(artifact: BranchArtifact) -> bool:
    return artifact.spec is not None and artifact.spec.profile is not None


def _measured_profiles(
    model_dir: Path, artifacts: Sequence[BranchArtifact], trust: Trust | None
) -> tuple[dict[str, BranchProfile | None], list[str]]:
    result: dict[str, BranchProfile | None] = {a.name: None for a in artifacts}
    if not artifacts:
        return result, []
    model = artifacts[0].model
    try:
        doc = read_profile(model_dir, trust)
    except FileNotFoundError:
        if all(_declares(a) for a in artifacts if not a.is_reference):
            return result, []
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
        key = profile_key(art)
        rec = doc.branches.get(key)
        if rec is None:
            old = next((k for k, r in doc.branches.items() if r.branch == art.name), None)
            if old is not None and art.url is not None:
                warnings.append(
                    f"{model}:{art.name}: its url or remote_model changed since it was "
                    "profiled; its profile is ignored until `quantroute profile` runs again"
                )
            elif old is not None:
                warnings.append(
                    f"{model}:{art.name}: {art.path.name} changed since it was profiled "
                    f"(sha256 {art.sha256[:12]}..., profiled {old[:12]}...); its profile is "
                    "ignored until `quantroute profile` runs again"
                )
            elif not _declares(art):
                warnings.append(f"{model}:{art.name}: not profiled yet")
            continue
        result[art.name] = BranchProfile(
            model=model,
            branch=art.name,
            precision=art.precision,
            sha256=key,
            quality=rec.quality,
            file_bytes=rec.footprint.file_bytes,
            rss_bytes=rec.footprint.rss_bytes,
            prefill_tps=rec.speed.prefill_tps,
            decode_tps=rec.speed.decode_tps,
            measured_at=rec.measured_at,
            fidelity=rec.fidelity or FULL,
        )
    return result, warnings


def stale_profiles(
    model_dir: Path, artifacts: Sequence[BranchArtifact], trust: Trust | None = None
) -> frozenset[str]:
    """The branches whose profile measured another file than theirs (replaced since it
    was profiled; or, when the reference's file changed, every profiled branch). Such
    a branch is unprofiled (:func:`load_profiles` gives it ``None``) and reported
    *stale* until ``quantroute profile`` runs again. A remote branch is stale when its
    endpoint (url, remote model) changed since it was profiled."""
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
        a.name for a in artifacts if a.name in profiled and profile_key(a) not in doc.branches
    )

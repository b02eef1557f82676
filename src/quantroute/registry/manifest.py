"""The model manifest, ``quantroute.yaml``: one per model folder.

::

    model: tiny-llama
    reference: f16               # the branch every other branch is measured against
    branches:
      f16:    {file: f16.gguf,    precision: f16,    sha256: 9f2c...}
      q8_0:   {file: q8_0.gguf,   precision: q8_0,   sha256: 41d0...}
      q4_k_m: {file: q4_k_m.gguf, precision: q4_k_m, sha256: c7aa...}

Loading verifies every file's sha256 before anything runs it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry.gguf_check import check_gguf
from quantroute.types import Precision

MANIFEST_NAME = "quantroute.yaml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class BranchSpec(BaseModel):
    """One precision of a model, as the manifest declares it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(description="GGUF file, relative to the model folder.")
    precision: Precision
    engine: Literal["llamacpp"] = "llamacpp"
    sha256: str = Field(description="Hex sha256 of the file; checked before loading.")

    @field_validator("file")
    @classmethod
    def _relative(cls, value: str) -> str:
        path = Path(value)
        if path.is_absolute() or ".." in path.parts:
            raise ValueError("file must be a path inside the model folder")
        return value

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: str) -> str:
        if not _SHA256.match(value):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        return value


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    reference: str
    description: str = ""
    branches: dict[str, BranchSpec]

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("model name must be 1-128 of A-Z a-z 0-9 . _ -")
        return value

    @model_validator(mode="after")
    def _branches(self) -> Manifest:
        if not self.branches:
            raise ValueError("a model needs at least one branch")
        for name in self.branches:
            if not _NAME.match(name):
                raise ValueError(f"branch name {name!r} must be 1-128 of A-Z a-z 0-9 . _ -")
        if self.reference not in self.branches:
            raise ValueError(f"reference branch {self.reference!r} is not among the branches")
        return self


@dataclass(frozen=True, slots=True)
class BranchArtifact:
    """A branch's file. ``problem`` is ``None`` when it exists, matches its declared
    sha256 and has a sound GGUF header; otherwise it says what is wrong, in words,
    and the branch is failed (it never starts)."""

    model: str
    name: str
    precision: Precision
    engine: str
    path: Path
    sha256: str
    size_bytes: int
    is_reference: bool
    problem: str | None = None


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def load_manifest(model_dir: Path) -> Manifest:
    path = model_dir / MANIFEST_NAME
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path} is not valid YAML") from exc
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestError(f"{path}: {where}: {first['msg']}") from exc


def check_artifacts(model_dir: Path, manifest: Manifest) -> list[BranchArtifact]:
    """Every branch's file, checked: exists, matches its sha256, has a sound GGUF header
    (:func:`~quantroute.registry.gguf_check.check_gguf`). A bad file fails its branch
    alone (``problem``); the reference comes first."""
    artifacts = []
    for name, spec in manifest.branches.items():
        path = (model_dir / spec.file).resolve()
        problem, digest, size = None, spec.sha256, 0
        if not path.is_file():
            problem = f"{manifest.model}:{name}: file {spec.file} is missing"
        else:
            size = path.stat().st_size
            digest = sha256_file(path)
            if digest != spec.sha256:
                problem = (
                    f"{manifest.model}:{name}: sha256 of {spec.file} is {digest[:12]}..., "
                    f"the manifest says {spec.sha256[:12]}..."
                )
            else:
                try:
                    check_gguf(path)
                except ArtifactIntegrityError as exc:
                    problem = f"{manifest.model}:{name}: {spec.file}: {exc.message}"
        artifacts.append(
            BranchArtifact(
                model=manifest.model,
                name=name,
                precision=spec.precision,
                engine=spec.engine,
                path=path,
                sha256=digest,
                size_bytes=size,
                is_reference=name == manifest.reference,
                problem=problem,
            )
        )
    artifacts.sort(key=lambda a: (not a.is_reference, a.precision.spec.rank, a.name))
    return artifacts


def verify_artifacts(model_dir: Path, manifest: Manifest) -> list[BranchArtifact]:
    """:func:`check_artifacts`, raising :class:`ArtifactIntegrityError` for the first bad
    file (the profiler and the builder need every file sound)."""
    artifacts = check_artifacts(model_dir, manifest)
    for artifact in artifacts:
        if artifact.problem is not None:
            raise ArtifactIntegrityError(artifact.problem)
    return artifacts


def write_manifest(model_dir: Path, manifest: Manifest) -> Path:
    """Write ``quantroute.yaml`` (used by the demo builder and by tests)."""
    data = manifest.model_dump(mode="json", exclude_defaults=False)
    path = model_dir / MANIFEST_NAME
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path

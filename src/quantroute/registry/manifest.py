"""The model manifest, ``quantroute.yaml``: one per model folder.

::

    model: tiny-llama
    reference: f16               # the branch every other branch is measured against
    branches:
      f16:    {file: f16.gguf,    precision: f16,    sha256: 9f2c...}
      q8_0:   {file: q8_0.gguf,   precision: q8_0,   sha256: 41d0...}
      q4_k_m: {file: q4_k_m.gguf, precision: q4_k_m, sha256: c7aa...}
      onnx_int8:                 # an ONNX Runtime branch: the graph and its vocabulary
        engine: onnxruntime
        file: onnx_int8/model.onnx
        precision: int8
        sha256: 3b1f...
        tokenizer: {file: onnx_int8/tokenizer.gguf, sha256: 0c9e...}
        # data: {file: onnx_int8/model.onnx.data, sha256: ...}  # weights beside the graph
      fp8:                       # a remote branch: an OpenAI-compatible server
        engine: openai
        url: http://gpu-a:8000/v1    # its OpenAI base URL
        precision: fp8
        remote_model: llama-3-8b-fp8 # the name it serves (default: the branch name)
        api_key_env: GPU_A_KEY       # the environment variable holding its key
    versions:                    # optional: more versions, each its own branches
      v2: {branches: {f16: {file: v2/f16.gguf, precision: f16, sha256: 77e1...}}}
    traffic:                     # optional: which requests get which version
      - {version: v2, header: x-ab-group, value: b}
      - {version: v2, percent: 10}

Loading validates the schema (errors name the file, the field and the
problem); checking verifies every file's sha256 and header (GGUF; an ONNX
branch's graph and tokenizer: ``registry.onnx_check``; its external data file, by
sha256, and the graph's tensors against it) before anything runs it. See docs/repository.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from quantroute.errors import ArtifactIntegrityError, ManifestError
from quantroute.registry.branch import _DEFAULT_REMOTE, EngineRules
from quantroute.registry.branch import BranchSpec as BranchSpec  # its old home (demo/builder.py)
from quantroute.registry.digests import Checked, Digests, Identity, identity
from quantroute.registry.digests import sha256_file as sha256_file  # its old home
from quantroute.registry.gguf_check import check_gguf
from quantroute.registry.onnx_check import DataFile
from quantroute.registry.onnx_pair import PairFound, check_onnx_pair
from quantroute.registry.verified import VerifiedFile
from quantroute.types import Precision, versioned_name

MANIFEST_NAME = "quantroute.yaml"
MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a few KiB; more is not one
MANIFEST_MAX_NESTING = 64  # flow brackets ([ {) open at once; PyYAML recurses per level
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEADER = re.compile(r"^[A-Za-z0-9-]+$")


class VersionSpec(BaseModel):
    """A further version of the model: its own branches (and reference)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reference: str | None = Field(default=None, description="Defaults to the model's.")
    branches: dict[str, BranchSpec]


class TrafficRule(BaseModel):
    """Who gets ``version``: requests whose ``header`` equals ``value`` (an A/B group), or
    ``percent`` of users by a stable hash of the user (sticky per user)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    percent: float | None = Field(default=None, gt=0, le=100)
    header: str | None = Field(default=None, min_length=1, max_length=128)
    value: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_kind(self) -> TrafficRule:
        by_header = self.header is not None or self.value is not None
        if by_header == (self.percent is not None):
            raise ValueError("a traffic rule has either percent, or header and value")
        if by_header and (self.header is None or self.value is None):
            raise ValueError("a header rule needs both header and value")
        if self.header is not None and not _HEADER.match(self.header):
            raise ValueError(f"header {self.header!r} is not a header name")
        return self


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    reference: str
    description: str = ""
    branches: dict[str, BranchSpec]
    version: str = Field(default="v1", description="The top-level branches' version.")
    versions: dict[str, VersionSpec] = Field(default_factory=dict)
    default_version: str | None = Field(default=None, description="Without a rule: this.")
    traffic: list[TrafficRule] = Field(default_factory=list)

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("model name must be 1-128 of A-Z a-z 0-9 . _ -")
        return value

    @model_validator(mode="after")
    def _branches(self) -> Manifest:
        if not _NAME.match(self.version):
            raise ValueError("version: a version name must be 1-128 of A-Z a-z 0-9 . _ -")
        _check_branches("branches", self.branches, self.reference)
        for name, spec in self.versions.items():
            if not _NAME.match(name) or name == self.version:
                raise ValueError(
                    f"versions.{name}: a version name must be new and 1-128 of A-Z a-z 0-9 . _ -"
                )
            _check_branches(
                f"versions.{name}.branches", spec.branches, spec.reference or self.reference
            )
        names = self.version_names()
        if self.default_version is not None and self.default_version not in names:
            raise ValueError(f"default_version {self.default_version!r} is not a version")
        if self.traffic and not self.versions:
            raise ValueError("traffic rules need versions to send traffic to")
        for i, rule in enumerate(self.traffic):
            if rule.version not in names:
                raise ValueError(f"traffic.{i}.version: {rule.version!r} is not a version")
        total = sum(r.percent or 0.0 for r in self.traffic)
        if total > 100:
            raise ValueError(f"traffic: the percentages add up to {total:g} (at most 100)")
        return self

    def version_names(self) -> list[str]:
        return [self.version, *self.versions]

    def version_spec(self, version: str | None = None) -> tuple[str, dict[str, BranchSpec]]:
        """``(reference, branches)`` of ``version`` (``None``: the top-level one)."""
        if version is None or version == self.version:
            return self.reference, self.branches
        spec = self.versions[version]
        return spec.reference or self.reference, spec.branches


def _check_branches(where: str, branches: dict[str, BranchSpec], reference: str) -> None:
    if not branches:
        raise ValueError(f"{where}: a model needs at least one branch")
    for name in branches:
        if not _NAME.match(name):
            raise ValueError(f"{where}: branch name {name!r} must be 1-128 of A-Z a-z 0-9 . _ -")
    if reference not in branches:
        raise ValueError(f"{where}: reference branch {reference!r} is not among the branches")


@dataclass(frozen=True, slots=True)
class BranchArtifact:
    """A branch's file. ``problem`` is ``None`` when it exists, matches its declared
    sha256 and has a sound header (GGUF, or an ONNX graph); otherwise it says what is
    wrong, in words, and the branch is failed (it never starts). An ONNX branch's
    ``tokenizer`` is its second file, checked the same way, and ``data`` its graph's
    external weights where it declares them (``None`` for the others, and once any of
    its files failed). ``version`` is ``None`` for a model that declares no
    versions. A remote branch (``url``) has the model folder as its ``path``, no sha256
    and no problem: its engine checks the server."""

    model: str
    name: str
    precision: Precision
    engine: str
    path: Path
    sha256: str
    size_bytes: int
    is_reference: bool
    problem: str | None = None
    version: str | None = None
    url: str | None = None
    spec: BranchSpec | None = None
    file_id: Identity | None = None  # registry.digests.identity when its sha256 was read
    settled: bool = False  # ... and the file had been still for RACY_S then
    tokenizer: VerifiedFile | None = None  # an ONNX branch's vocabulary, as checked
    tokenizer_path: Path | None = None  # ... where it is (checked or not)
    data: VerifiedFile | None = None  # an ONNX graph's external data file, as checked
    data_path: Path | None = None  # ... where it is (checked or not)

    @property
    def device(self) -> str | None:
        """The device the manifest pins the branch to (``device:``), if any; a remote
        branch's is its server, ``remote:host:port``."""
        if self.url is not None:
            return remote_device(self.url)
        return self.spec.device if self.spec is not None else None

    def replaced(self) -> bool:
        """The file at ``path`` is no longer the one that was checked (renamed over,
        rewritten in place — its mtime set back or not: ctime and size tell —, removed):
        a worker must not load it unchecked (``registry.verified``)."""
        if self.file_id is None:
            return False
        checked = [(self.path, self.file_id)]
        for extra in (self.tokenizer, self.data):
            if extra is not None:
                checked.append((extra.path, extra.identity))
        for path, was in checked:
            try:
                st = path.stat()
            except OSError:
                return True
            if identity(st) != was:
                return True
        return False

    def verified(self) -> VerifiedFile | None:
        """What a worker may load (``registry.verified``); ``None`` for a file that did
        not pass its checks (or a remote branch)."""
        if self.problem is not None or self.file_id is None or self.spec is None:
            return None
        return VerifiedFile(self.path, self.spec.file, self.sha256, self.file_id, self.settled)

    def verified_tokenizer(self) -> VerifiedFile | None:
        """An ONNX branch's tokenizer as a worker may load it (``registry.verified``);
        ``None`` for other branches and for one whose files did not pass their checks."""
        return self.tokenizer if self.problem is None and self.file_id is not None else None

    def verified_data(self) -> VerifiedFile | None:
        """An ONNX graph's external data file as a worker may load it
        (``registry.verified``); ``None`` for a branch that declares none and for one
        whose files did not pass their checks."""
        return self.data if self.problem is None and self.file_id is not None else None

    def data_file(self) -> DataFile | None:
        """The declared external data file as the graph check takes it (its name beside
        the graph, its verified size): what ``registry.onnx_check`` checks the graph's
        external tensors against; ``None`` without a verified one."""
        data = self.verified_data()
        if data is None or self.spec is None or self.spec.data is None:
            return None
        return DataFile(Path(self.spec.data.file).name, data.identity[2])

    @property
    def route(self) -> str:
        """The route this branch belongs to: ``model`` or ``model@version``."""
        return versioned_name(self.model, self.version)


def remote_device(url: str) -> str:
    """The device id of a remote server: ``remote:`` and its URL's host and port."""
    split = urlsplit(url)
    port = split.port or (443 if split.scheme == "https" else 80)
    return f"remote:{split.hostname}:{port}"


def load_manifest(model_dir: Path, engines: Mapping[str, EngineRules] | None = None) -> Manifest:
    """Parse and validate ``model_dir/quantroute.yaml``; a :class:`ManifestError` names
    the file (relative to the repository), the field and the problem (up to three).
    With ``engines`` (``engines.table.ENGINES``), each branch's engine must be one of
    them and take the branch's source and precision."""
    return parse_manifest(model_dir, read_manifest(model_dir), engines)


def read_manifest(model_dir: Path) -> bytes:
    """The bytes of ``model_dir/quantroute.yaml`` (read once: a signed model's are
    compared with what its signature verified, ``registry.repository``)."""
    try:
        with (model_dir / MANIFEST_NAME).open("rb") as fh:
            data = fh.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        raise ManifestError(
            f"cannot read {model_dir.name}/{MANIFEST_NAME}: {exc.strerror}"
        ) from exc
    if len(data) > MANIFEST_MAX_BYTES:
        raise ManifestError(
            f"{model_dir.name}/{MANIFEST_NAME} is over {MANIFEST_MAX_BYTES >> 20} MiB"
        )
    return data


def parse_manifest(
    model_dir: Path, data: bytes, engines: Mapping[str, EngineRules] | None = None
) -> Manifest:
    """Validate ``data``, the manifest of ``model_dir`` (see :func:`load_manifest`)."""
    path = f"{model_dir.name}/{MANIFEST_NAME}"  # never an absolute path: it is shown
    if _nesting(data) > MANIFEST_MAX_NESTING:
        raise ManifestError(f"{path} nests deeper than {MANIFEST_MAX_NESTING} levels")
    try:
        raw = yaml.safe_load(data.decode())
    # ValueError: a date that is none, an integer past Python's digit limit;
    # RecursionError: flow nesting past the recursion limit
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is not valid YAML") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{path}: the manifest must be a mapping (model, reference, branches)")
    try:
        return Manifest.model_validate(raw, context={"engines": engines})
    except ValidationError as exc:
        raise ManifestError(
            f"{path}: " + "; ".join(_describe(e) for e in exc.errors()[:3])
        ) from exc


def _nesting(data: bytes) -> int:
    """The most flow brackets open at once, in one pass (quotes not parsed: a bracket in
    a string counts too, which only a manifest of absurd strings would notice)."""
    depth = deepest = 0
    for byte in data.translate(None, _NOT_BRACKETS):
        depth = depth + 1 if byte in b"[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def check_artifacts(
    model_dir: Path,
    manifest: Manifest,
    version: str | None = None,
    *,
    isolated: bool = False,
    timeout_s: float | None = None,
    memory_bytes: int | None = None,
    digests: Digests | None = None,
    follow_links: bool = False,
) -> list[BranchArtifact]:
    """Every branch's file of ``version`` (``None``: the top-level branches), checked:
    exists, resolves inside ``model_dir`` (unless ``follow_links``), matches its sha256
    (read through ``digests``: see ``registry.digests``), has a sound header — GGUF
    (:func:`~quantroute.registry.gguf_check.check_gguf`), or for an ONNX branch its
    graph and tokenizer (:func:`~quantroute.registry.onnx_pair.check_onnx_pair`) —;
    with ``isolated``, the headers are read in child processes bounded in time and
    memory. A bad file fails its branch alone (``problem``: in words, naming the file as
    the manifest does, never with its digest); the reference comes first."""
    reference, branches = manifest.version_spec(version)
    tag = None if not manifest.versions else (version or manifest.version)
    label = versioned_name(manifest.model, tag)
    files = _Files(model_dir, model_dir.resolve(), digests or Digests(), follow_links)
    artifacts = []
    ggufs: list[int] = []  # indices of the artifacts whose GGUF headers are to be checked
    onnx: list[int] = []  # ... and of ONNX branches (graph and tokenizer)
    for name, spec in branches.items():
        if spec.url is not None:  # nothing on disk to check: its engine probes the server
            artifacts.append(
                _artifact(manifest, tag, name, spec, model_dir, "", 0, reference, None)
            )
            continue
        where = f"{label}:{name}:"
        path, problem, checked = files.read(spec.file, spec.sha256, where)
        more: dict[str, tuple[VerifiedFile | None, Path | None]] = {}
        for what, declared in (("tokenizer", spec.tokenizer), ("data", spec.data)):
            if declared is None:
                continue
            verified, fpath = None, (model_dir / declared.file).resolve()
            if problem is None:
                fpath, problem, read = files.read(declared.file, declared.sha256, where, what)
                if read is not None and read.identity is not None:
                    verified = VerifiedFile(
                        fpath, declared.file, declared.sha256, read.identity, read.settled
                    )
            more[what] = (verified, fpath)
        tokenizer, tpath = more.get("tokenizer", (None, None))
        data, dpath = more.get("data", (None, None))
        # the declared sha256, whatever the file's is: a failed branch shows no digest of it
        local = _artifact(manifest, tag, name, spec, path, spec.sha256, 0, reference, problem)
        local = replace(local, tokenizer_path=tpath, data_path=dpath)
        if problem is None and checked is not None and checked.identity is not None:
            (onnx if spec.tokenizer is not None else ggufs).append(len(artifacts))
            local = replace(
                local,
                size_bytes=checked.identity[2],
                file_id=checked.identity,
                settled=checked.settled,
                tokenizer=tokenizer,
                data=data,
            )
        artifacts.append(local)
    limits: dict[str, Any] = {"timeout_s": timeout_s, "memory_bytes": memory_bytes}
    limits = {k: v for k, v in limits.items() if v is not None}
    refusals = _check_ggufs([artifacts[i].path for i in ggufs], isolated, limits)
    for i, refused in zip(ggufs, refusals, strict=True):
        if refused is not None:
            artifacts[i] = _refused(artifacts[i], label, refused)
    pairs = [(artifacts[i].path, _tokenizer_path(artifacts[i])) for i in onnx]
    datas = [artifacts[i].data_file() for i in onnx]
    for i, found in zip(onnx, _check_onnx(pairs, datas, isolated, limits), strict=True):
        if found.model is not None:
            artifacts[i] = _refused(artifacts[i], label, found.model)
        elif found.tokenizer is not None:
            artifacts[i] = _refused(artifacts[i], label, found.tokenizer, tokenizer=True)
    for i in (*ggufs, *onnx):  # the checks read paths: what they read must be what was hashed
        if artifacts[i].problem is None and artifacts[i].replaced():
            artifacts[i] = _refused(artifacts[i], label, "changed while it was being checked")
    artifacts.sort(key=lambda a: (not a.is_reference, a.precision.spec.rank, a.name))
    return artifacts


@dataclass(frozen=True, slots=True)
class _Files:
    """How a model folder's declared files are read (see :func:`check_artifacts`)."""

    model_dir: Path
    folder: Path  # model_dir resolved
    digests: Digests
    follow_links: bool

    def read(
        self, declared: str, sha256: str, where: str, what: str = "file"
    ) -> tuple[Path, str | None, Checked | None]:
        """One declared file: its resolved path, and why it fails its branch (``None``:
        it lies inside the model folder and matches ``sha256``) or its read digest."""
        path = (self.model_dir / declared).resolve()
        name = declared if what == "file" else f"{what} {declared}"
        if not self.follow_links and not path.is_relative_to(self.folder):
            why = "leads out of the model folder (repository.follow_links is off)"
            return path, f"{where} {what} {declared} {why}", None
        if not path.is_file():
            return path, f"{where} {what} {declared} is missing", None
        try:
            checked = self.digests.check(path)
        except OSError as exc:  # unreadable, or no longer a regular file (swapped meanwhile)
            return path, f"{where} {what} {declared} cannot be read ({exc.strerror})", None
        if checked.identity is None:
            return path, f"{where} {name} changed while it was being checked", None
        if checked.sha256 != sha256:
            # never the digest it has: the file may be any readable file (a link)
            field = "sha256" if what == "file" else f"{what}.sha256"
            return path, f"{where} {name} does not match the manifest's {field}", None
        return path, None, checked


def _tokenizer_path(a: BranchArtifact) -> Path | None:
    return a.tokenizer.path if a.tokenizer is not None else None


def _refused(
    a: BranchArtifact, label: str, reason: str, *, tokenizer: bool = False
) -> BranchArtifact:
    """``a`` failed by its header check: ``reason`` names no file, the manifest's name does."""
    if tokenizer and a.spec is not None and a.spec.tokenizer is not None:
        where = f"tokenizer {a.spec.tokenizer.file}"
    else:
        where = a.spec.file if a.spec is not None else a.path.name
    problem = f"{label}:{a.name}: {where}: {reason}"
    return replace(a, problem=problem, file_id=None, tokenizer=None, data=None)


def _check_ggufs(paths: list[Path], isolated: bool, limits: dict[str, Any]) -> list[str | None]:
    from quantroute.registry.gguf_check import check_gguf_isolated

    if not paths:
        return []
    if isolated:
        return check_gguf_isolated(paths, **limits)
    return [_check_in_process(p) for p in paths]


def _check_onnx(
    pairs: list[tuple[Path, Path | None]],
    data: list[DataFile | None],
    isolated: bool,
    limits: dict[str, Any],
) -> list[PairFound]:
    from quantroute.registry.onnx_pair import check_onnx_isolated

    if not pairs:
        return []
    if isolated:
        return check_onnx_isolated(pairs, data=data, **limits)
    return [check_onnx_pair(m, t, d) for (m, t), d in zip(pairs, data, strict=True)]


def _check_in_process(path: Path) -> str | None:
    try:
        check_gguf(path)
    except ArtifactIntegrityError as exc:
        return exc.message
    return None


def _artifact(
    manifest: Manifest,
    version: str | None,
    name: str,
    spec: BranchSpec,
    path: Path,
    digest: str,
    size: int,
    reference: str,
    problem: str | None,
) -> BranchArtifact:
    return BranchArtifact(
        model=manifest.model,
        name=name,
        precision=spec.precision,
        engine=spec.engine,
        path=path,
        sha256=digest,
        size_bytes=size,
        is_reference=name == reference,
        problem=problem,
        version=version,
        url=spec.url,
        spec=spec,
    )


def check_versions(model_dir: Path, manifest: Manifest, **how: Any) -> list[list[BranchArtifact]]:
    """:func:`check_artifacts` of every version of the model (``how``: its keyword
    arguments), the top-level one first."""
    return [check_artifacts(model_dir, manifest, v, **how) for v in manifest.version_names()]


def verify_artifacts(
    model_dir: Path, manifest: Manifest, *, isolated: bool = False
) -> list[BranchArtifact]:
    """:func:`check_artifacts`, raising :class:`ArtifactIntegrityError` for the first bad
    file (the profiler and the builder need every file sound)."""
    artifacts = check_artifacts(model_dir, manifest, isolated=isolated)
    for artifact in artifacts:
        if artifact.problem is not None:
            raise ArtifactIntegrityError(artifact.problem)
    return artifacts


def write_manifest(model_dir: Path, manifest: Manifest) -> Path:
    """Write ``quantroute.yaml`` (used by the demo builder and by tests)."""
    data = manifest.model_dump(mode="json", exclude_none=True)
    for spec in [data["branches"], *(v["branches"] for v in data["versions"].values())]:
        for branch in spec.values():
            for key in ("options", "file", "sha256"):
                if not branch[key]:
                    del branch[key]
            if branch["remote"] == _DEFAULT_REMOTE:
                del branch["remote"]
    if not manifest.versions:
        for key in ("version", "versions", "traffic"):
            del data[key]
    elif not manifest.traffic:
        del data["traffic"]
    path = model_dir / MANIFEST_NAME
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path

"""One branch as a manifest declares it (:class:`BranchSpec`): a local GGUF file with its
sha256; an ONNX decoder's ``model.onnx`` with its sha256 and its tokenizer
(:class:`TokenizerFile`, a GGUF holding the vocabulary, with its own sha256); or a remote
server's URL with the name it serves, the variable holding its key and how to reach it
(:class:`RemoteOptions`); a local branch's own engine settings (:class:`EngineOptions`);
a remote's declared fidelity (:class:`DeclaredProfile`).

A branch with a ``tokenizer`` is an ONNX branch: its ``file`` is an ONNX graph
(``.onnx``, the layout of ``engines/onnx/layout.py``) and is checked as one
(``registry.onnx_check``); every other file is checked as GGUF. An ONNX graph whose
weights lie in a file beside it (ONNX external data, ``model.onnx.data``: any graph past
2 GiB) declares that file as its ``data``, a :class:`DeclaredFile` in the graph's folder,
checked by sha256 like the others; the graph must name exactly that file. Which engine takes which
source, precision and tokenizer is the engine table's to say (``engines.table``); the
registry sees it as :class:`EngineRules`, passed in the validation context
(``parse_manifest(engines=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from quantroute.types import Precision

__all__ = [
    "BranchSpec",
    "DeclaredFile",
    "DeclaredProfile",
    "EngineOptions",
    "EngineRules",
    "RemoteOptions",
    "RemoteServer",
    "TokenizerFile",
]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*$")
_DEVICE = re.compile(r"^(cpu|cuda:[0-9]{1,3}|sim:[0-9]{1,3})$")
_ENGINE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_REMOTE_MODEL = re.compile(r"^[^\s\x00-\x1f]{1,256}$")
# ONNX's names for two precisions quantroute writes one way for every engine
_SPELLED = {"fp16": "f16", "fp32": "f32"}


class EngineRules(Protocol):
    """What the manifest checks of an engine a branch names (``engines.table``'s
    entries satisfy it): what it runs (``file`` or ``url``) and which precisions."""

    @property
    def source(self) -> str: ...

    @property
    def precisions(self) -> frozenset[Precision]: ...

    @property
    def tokenizer(self) -> bool:
        """Its file is an ONNX graph that needs a ``tokenizer`` file beside it."""
        ...


class EngineOptions(BaseModel):
    """A branch's own engine settings; unset ones come from ``engine.*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_ctx: int | None = Field(default=None, ge=16, le=1 << 20, description="Context length.")
    parallel: int | None = Field(default=None, ge=1, le=256, description="Decode slots.")
    n_batch: int | None = Field(default=None, ge=1, le=1 << 16, description="Prompt batch size.")
    n_threads: int | None = Field(default=None, ge=1, le=1024, description="Threads of the worker.")


def _relative_path(value: str) -> str:
    path = Path(value)
    if value and (path.is_absolute() or ".." in path.parts):
        raise ValueError("file must be a path inside the model folder")
    return value


def _sha256_hex(value: str) -> str:
    if value and not _SHA256.match(value):
        raise ValueError("sha256 must be 64 lowercase hex digits")
    return value


class DeclaredFile(BaseModel):
    """A further file of an ONNX branch, checked by sha256 before anything reads it: its
    vocabulary (``tokenizer``: a GGUF holding the tokenizer's metadata, no tensors needed;
    llama.cpp loads it ``vocab_only``; its header is checked too) or its graph's external
    weights (``data``: ``model.onnx.data``, the bytes the graph's tensors point into)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(min_length=1, description="GGUF file, relative to the model folder.")
    sha256: str = Field(min_length=1, description="Hex sha256 of the file.")

    _relative = field_validator("file")(_relative_path)
    _hex = field_validator("sha256")(_sha256_hex)


TokenizerFile = DeclaredFile  # its first use's name (demo/onnx_export.py, tests)


RemoteServer = Literal["auto", "vllm", "sglang", "llama-server", "quantroute", "openai"]


class RemoteOptions(BaseModel):
    """A remote branch's connection: its pool, timeouts, health probe and what kind of
    server it is (``auto``: told by its metrics; it decides which extensions to
    OpenAI's fields, such as ``top_k``, it is sent)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: RemoteServer = "auto"
    max_connections: int = Field(
        default=64, ge=1, le=4096, description="Pooled connections, at most."
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600, description="To open a connection.")
    first_token_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="From the request to its first token."
    )
    idle_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Between two chunks.")
    probe_interval_s: float = Field(
        default=2.0, ge=0.05, le=600, description="Health and load probe."
    )
    logprobs: bool = Field(
        default=True, description="It returns logprobs (False: refused with a 400)."
    )
    max_event_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="The largest SSE event taken from it."
    )


_DEFAULT_REMOTE = RemoteOptions().model_dump(mode="json")


class DeclaredProfile(BaseModel):
    """A remote branch's fidelity as its operator declares it (a server that returns no
    logprobs cannot be measured): shown as declared, never as measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean_kld: float = Field(ge=0.0, le=100.0)
    top1: float = Field(ge=0.0, le=1.0)
    decode_tps: float | None = Field(default=None, gt=0)
    prefill_tps: float | None = Field(default=None, gt=0)


class BranchSpec(BaseModel):
    """One precision of a model, as the manifest declares it: a local GGUF ``file``
    (with its ``sha256``) run by llama.cpp; an ONNX graph ``file`` with its ``sha256``
    and its ``tokenizer`` (``engine: onnxruntime``); or a remote ``url`` (an
    OpenAI-compatible server: vLLM, SGLang, llama-server, another quantroute) run by
    ``engine: openai``. Which engine takes which source, precision and tokenizer is
    ``engines.table``'s to say; the scan checks it (``parse_manifest(engines=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(
        "", description="GGUF file (an ONNX branch: its .onnx graph), relative to the model folder."
    )
    url: str | None = Field(default=None, description="A remote engine's base URL.")
    precision: Precision
    engine: str = Field(default="llamacpp", description="An entry of the engine table.")
    sha256: str = Field("", description="Hex sha256 of the file; checked before loading.")
    tokenizer: DeclaredFile | None = Field(
        default=None, description="An ONNX branch's vocabulary: a GGUF file and its sha256."
    )
    data: DeclaredFile | None = Field(
        default=None,
        description="An ONNX graph's external weights (model.onnx.data) and their sha256.",
    )
    device: str | None = Field(default=None, description="Device hint: cpu, cuda:N or sim:N.")
    options: EngineOptions = EngineOptions()
    remote_model: str | None = Field(
        default=None, description="The model name the remote serves (default: the branch's)."
    )
    api_key_env: str | None = Field(
        default=None, description="The environment variable holding the remote's key."
    )
    remote: RemoteOptions = RemoteOptions()
    profile: DeclaredProfile | None = Field(
        default=None, description="Declared fidelity, for a remote that returns no logprobs."
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _one_spelling(cls, value: object) -> object:
        if isinstance(value, str) and value in _SPELLED:
            raise ValueError(
                f"precision {value} is written {_SPELLED[value]} (one name per precision, "
                "whatever the engine)"
            )
        return value

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str, info: ValidationInfo) -> str:
        if not _ENGINE.match(value):
            raise ValueError("engine must be a lowercase name (llamacpp, openai, ...)")
        engines = (info.context or {}).get("engines")
        if engines is not None and value not in engines:
            raise ValueError(f"unknown engine; the engines are {', '.join(sorted(engines))}")
        return value

    @field_validator("remote_model")
    @classmethod
    def _remote_model(cls, value: str | None) -> str | None:
        if value is not None and not _REMOTE_MODEL.match(value):
            raise ValueError("remote_model must be 1-256 printable characters, no spaces")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            raise ValueError("api_key_env must name an environment variable (never the key)")
        return value

    _relative = field_validator("file")(_relative_path)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not _URL.match(value):
            raise ValueError("url must be an http:// or https:// URL with a host")
        return value

    _hex = field_validator("sha256")(_sha256_hex)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE.match(value):
            raise ValueError("device must be cpu, cuda:N or sim:N")
        return value

    @model_validator(mode="after")
    def _source(self, info: ValidationInfo) -> BranchSpec:
        if bool(self.file) == (self.url is not None):
            raise ValueError("a branch has exactly one of file (local) or url (remote)")
        if self.file and not self.sha256:
            raise ValueError("a file branch needs its sha256 (checked before loading)")
        remote_only = ("remote_model", "api_key_env", "profile")
        if self.file and any(getattr(self, f) is not None for f in remote_only):
            raise ValueError("remote_model, api_key_env and profile are for url branches")
        if self.tokenizer is not None and not self.file:
            raise ValueError("a tokenizer is for a file branch (an ONNX graph)")
        engines: Mapping[str, EngineRules] | None = (info.context or {}).get("engines")
        rules = engines.get(self.engine) if engines is not None else None
        if rules is not None:
            source = "file" if self.file else "url"
            if rules.source != source:
                raise ValueError(f"engine {self.engine} runs a {rules.source}, not a {source}")
            if self.precision not in rules.precisions:
                raise ValueError(f"engine {self.engine} does not run precision {self.precision}")
            if source == "file" and rules.tokenizer and self.tokenizer is None:
                raise ValueError(
                    f"engine {self.engine} needs a tokenizer: {{file, sha256}} of a GGUF "
                    "holding the vocabulary"
                )
            if self.tokenizer is not None and not rules.tokenizer:
                raise ValueError(
                    f"engine {self.engine} takes no tokenizer (a GGUF file carries its own)"
                )
        elif engines is None and self.engine == "llamacpp" and self.url is not None:
            raise ValueError("a url branch needs a remote engine (engine: openai)")
        if self.tokenizer is not None and Path(self.file).suffix != ".onnx":
            raise ValueError(
                f"file {self.file}: a branch with a tokenizer is an ONNX graph, named .onnx"
            )
        if self.data is not None:
            if self.tokenizer is None:
                raise ValueError("data (external weights) is for an ONNX branch's graph")
            if Path(self.data.file).parent != Path(self.file).parent:
                raise ValueError(
                    f"data {self.data.file} must lie beside its graph {self.file} (ONNX "
                    "external data is named relative to the graph's folder)"
                )
            if self.data.file in (self.file, self.tokenizer.file):
                raise ValueError(f"data {self.data.file} is another file than the graph's")
        return self

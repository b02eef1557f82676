"""``Settings.repository``: the model repository while serving: signatures, file
checks, hot reload (``registry/``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class RepositorySettings(BaseModel):
    """The model repository while serving: signatures, file checks, hot reload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    require_signatures: bool = Field(
        False,
        description="Refuse a model without a model.sig that verifies (OpenSSF model signing).",
    )
    public_key: Path | None = Field(
        None, description="EC public key (PEM) that verifies model signatures, offline."
    )
    sigstore_identity: str | None = Field(
        None, description="Sigstore signer identity (an email or URI) that signatures must have."
    )
    sigstore_issuer: str | None = Field(
        None, description="OIDC issuer of sigstore_identity, e.g. https://accounts.google.com."
    )
    watch: bool = Field(
        True, description="Reload a model when its folder changes (temporary files are ignored)."
    )
    watch_debounce_ms: int = Field(
        1000, ge=50, le=60_000, description="Quiet time after the last change before reloading."
    )
    drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for requests on a replaced version to finish before it stops.",
    )
    drain_quiet_s: float = Field(
        0.5,
        ge=0,
        description="A replaced version stops once it has had nothing in flight this long.",
    )
    check_timeout_s: float = Field(
        30.0, gt=0, description="Time limit of the child process that checks GGUF headers."
    )
    check_memory_bytes: int = Field(
        1 << 30, ge=64 << 20, description="Address-space limit of the GGUF-checking child."
    )
    follow_links: bool = Field(
        False,
        description="Follow a symbolic link (a branch's file or folder) that leads out of its "
        "model's folder; off: such a file fails its branch.",
    )

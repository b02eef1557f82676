"""``Settings.cluster``: what a fleet of gateways shares (``cluster/``).

With ``etcd_endpoints`` set, what operators change at runtime (branch drains, traffic
rules, tenants) lives in etcd under ``/<name>/`` and every gateway watches it
(docs/cluster.md); ``redis_url`` is where streams and rate-limit windows are shared.
Neither set: every gateway keeps all of it in its own process, as one box does.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import NoDecode

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ClusterSettings(BaseModel):
    """The fleet's shared state: etcd (operators' changes) and Redis (streams, limits)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # NoDecode: the variable is read as text (a comma list, or a JSON list), not as JSON only
    etcd_endpoints: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="etcd client URLs (a comma list, or a list), e.g. "
        "http://etcd-0:2379,http://etcd-1:2379; empty: drains, traffic rules and tenants "
        "stay in this process (docs/cluster.md).",
    )
    redis_url: SecretStr | None = Field(
        None,
        description="Redis URL (redis://host:6379/0) of the streams and rate-limit windows "
        "the fleet shares; unset: kept in this process.",
    )
    name: str = Field(
        "quantroute",
        description="The fleet's name: its etcd keys are under /<name>/, so fleets can share "
        "one etcd.",
    )
    etcd_timeout_s: float = Field(
        2.0, gt=0, le=60, description="Time limit of one etcd request (a read, a write, a probe)."
    )
    etcd_probe_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="How often a gateway checks that etcd still answers while it watches "
        "(a watch on a dead connection says nothing).",
    )
    etcd_retry_max_s: float = Field(
        2.0,
        gt=0,
        le=300,
        description="Longest wait between attempts to reach etcd again after it failed.",
    )

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _endpoints(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = json.loads(text)
            else:
                value = [part for part in (p.strip() for p in text.split(",")) if part]
        if isinstance(value, list | tuple):
            for url in value:
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"an etcd endpoint is an http:// or https:// URL: {url!r}")
            return tuple(u.rstrip("/") for u in value)
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                "a cluster name is 1-63 letters, digits, '.', '_' or '-' (it is a key prefix)"
            )
        return value

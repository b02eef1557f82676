"""Where each piece of operator state lives in etcd, and the JSON it holds.

Every key of a fleet is under ``/<cluster.name>/`` (docs/cluster.md)::

    /<name>/branches/<model:branch>/admin  {"state": "drained", "reason": "disk swap"}
    /<name>/traffic/<model>                {"default_version": "v1",
                                            "traffic": [{"version": "v2", "percent": 10}]}
    /<name>/tenants/<tenant>               {"keys_sha256": ["<hex>"], "priority": 5, ...}

:func:`read_view` turns the keys under the prefix into one :class:`ClusterView`; it is
pure. A value that does not parse is left out and named, with why, in ``problems``:
the other keys still apply, and the key's last good value is not kept (an operator sees
the problem in ``/admin/status`` and writes the key again).

>>> layout = Layout("prod")
>>> layout.branch_admin("tiny-llama:f16")
'/prod/branches/tiny-llama:f16/admin'
>>> view = read_view(layout, {layout.branch_admin("m:b"): b'{"state": "drained"}'})
>>> sorted(view.drained)
['m:b']
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantroute.registry.manifest import TrafficRule
from quantroute.resilience.tenants import Tenant, TenantRecord
from quantroute.routing.versions import Rule, VersionSplit

MAX_VALUE_BYTES = 64 << 10  # a value larger than this is a mistake, not state


class Layout:
    """The keys of the fleet called ``name``."""

    def __init__(self, name: str):
        self.prefix = f"/{name}/"

    def branch_admin(self, branch_id: str) -> str:
        return f"{self.prefix}branches/{branch_id}/admin"

    def traffic(self, model: str) -> str:
        return f"{self.prefix}traffic/{model}"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}tenants/{name}"


class AdminRecord(BaseModel):
    """A branch's administrative state: ``drained`` takes no new requests."""

    model_config = ConfigDict(extra="forbid")

    state: Literal["drained", "active"]
    reason: str | None = Field(None, max_length=256)
    at: float | None = Field(None, description="When it was set (Unix time).")


class TrafficRecord(BaseModel):
    """A model's traffic rules, as its manifest writes them: they replace the manifest's."""

    model_config = ConfigDict(extra="forbid")

    default_version: str | None = None
    traffic: list[TrafficRule] = Field(default_factory=list, max_length=64)

    def checked(self) -> TrafficRecord:
        total = sum(r.percent or 0.0 for r in self.traffic)
        if total > 100:
            raise ValueError(f"traffic: the percentages add up to {total:g} (at most 100)")
        return self


@dataclass(frozen=True, slots=True)
class Traffic:
    """A model's traffic rules from etcd (``None`` default: the manifest's)."""

    default_version: str | None
    rules: tuple[Rule, ...]

    def split(self, base: VersionSplit) -> VersionSplit:
        """``base`` (the manifest's split) with these rules; ``ValueError`` names a version
        the model does not have."""
        versions = set(base.versions)
        named = [r.version for r in self.rules]
        if self.default_version is not None:
            named.append(self.default_version)
        unknown = sorted(set(named) - versions)
        if unknown:
            raise ValueError(
                f"{base.model} has no version {', '.join(unknown)} "
                f"(its versions: {', '.join(base.versions)})"
            )
        return VersionSplit(
            base.model, self.default_version or base.default, self.rules, base.versions
        )

    def to_json(self) -> dict[str, Any]:
        rules = []
        for r in self.rules:
            if r.percent is not None:
                rules.append({"version": r.version, "percent": r.percent})
            else:
                rules.append({"version": r.version, "header": r.header, "value": r.value})
        return {"default_version": self.default_version, "traffic": rules}


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the keys under a fleet's prefix say, parsed: the state every gateway applies."""

    drained: Mapping[str, str | None] = field(default_factory=lambda: MappingProxyType({}))
    traffic: Mapping[str, Traffic] = field(default_factory=lambda: MappingProxyType({}))
    tenants: tuple[tuple[bytes, Tenant], ...] = ()  # (key digest, tenant)
    tenant_names: tuple[str, ...] = ()
    problems: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def read_view(layout: Layout, items: Mapping[str, bytes]) -> ClusterView:
    """The view of ``items`` (key → value, every key under ``layout.prefix``)."""
    drained: dict[str, str | None] = {}
    traffic: dict[str, Traffic] = {}
    tenants: list[tuple[bytes, Tenant]] = []
    names: list[str] = []
    taken: set[bytes] = set()
    problems: dict[str, str] = {}
    for key in sorted(items):
        kind, _, rest = key.removeprefix(layout.prefix).partition("/")
        if kind == "branches" and rest.endswith("/admin"):
            name = rest.removesuffix("/admin")
        elif kind in ("traffic", "tenants") and rest and "/" not in rest:
            name = rest
        else:
            continue  # another part's key (Redis's, a newer gateway's): not ours to judge
        try:
            raw = _object(items[key])
            if kind == "branches":
                if name.count(":") != 1 or "/" in name:
                    raise ValueError("a branch is named model:branch")
                admin = AdminRecord.model_validate(raw)
                if admin.state == "drained":
                    drained[name] = admin.reason
            elif kind == "traffic":
                record = TrafficRecord.model_validate(raw).checked()
                traffic[name] = Traffic(
                    record.default_version,
                    tuple(
                        Rule(r.version, r.percent, r.header.lower() if r.header else None, r.value)
                        for r in record.traffic
                    ),
                )
            else:
                tenant, digests = TenantRecord.model_validate(raw).entries(name)
                if taken & set(digests):
                    raise ValueError("a key of this tenant is another tenant's")
                taken.update(digests)
                tenants += [(d, tenant) for d in digests]
                names.append(name)
        except (ValueError, ValidationError) as exc:
            problems[key] = _why(exc)
    return ClusterView(
        MappingProxyType(drained),
        MappingProxyType(traffic),
        tuple(tenants),
        tuple(names),
        MappingProxyType(problems),
    )


def _object(value: bytes) -> Any:
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"a value over {MAX_VALUE_BYTES} bytes")
    try:
        raw = json.loads(value)
    except ValueError as exc:
        raise ValueError("not JSON") from exc
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    return raw


def _why(exc: ValueError | ValidationError) -> str:
    """The problem in one line, never the value (it may hold what it should not)."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "value"
        return f"{where}: {str(first['msg']).removeprefix('Value error, ')}"
    return str(exc)

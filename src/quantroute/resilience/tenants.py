"""Tenants: API keys, and the limits each tenant's requests are held to.

The tenants file (``auth.tenants_file``, YAML) maps names to keys and limits::

    tenants:
      acme:
        keys: ["sk-acme-1", "sk-acme-2"]      # as the OpenAI client sends them (Bearer)
        priority: 5                           # admission: higher is served first
        max_priority: 5                       # the most a request's `priority` may reach
        requests_per_minute: 600
        tokens_per_minute: 200000             # prompt + completion tokens
        max_concurrency: 16                   # requests in flight at once
        models: ["tiny-llama"]                # or ["*"]

Keys are kept only as sha256 digests and compared in constant time against
every tenant's (no early exit that would time which one matched). A key is
never logged or echoed. :class:`TenantLimits` counts, per tenant, requests
and tokens over a sliding minute and the requests in flight; ``admit`` says
whether one more may start, and when to retry if not.

A request's own ``priority`` moves the tenant's by that much, but never above
the tenant's ``max_priority`` (by default its ``priority``: a request may lower
its place, never jump a tenant served before it), as SGLang's gateway clamps a
request to its tenant's class: :meth:`Tenant.priority_for`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantroute.errors import ConfigError

__all__ = ["OPEN", "Tenant", "TenantLimits", "Tenants", "load_tenants"]

WINDOW_S = 60.0


class _TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(min_length=1)
    priority: int = Field(0, ge=-10, le=10)
    max_priority: int | None = Field(None, ge=-10, le=10)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrency: int | None = Field(None, ge=1)
    models: list[str] = Field(default_factory=lambda: ["*"])


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, _TenantSpec] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    models: frozenset[str] = frozenset({"*"})
    max_priority: int | None = None  # ``None``: ``priority``

    def priority_for(self, requested: int | None) -> int:
        """The admission priority of a request that asks for ``requested`` (added to the
        tenant's, as the API documents): at most ``max_priority`` (by default the tenant's
        own), so a request can lower its place but never jump a tenant above it.

        >>> Tenant("acme", priority=2).priority_for(5), Tenant("acme", 2).priority_for(-3)
        (2, -1)
        """
        wanted = self.priority + (requested or 0)
        ceiling = self.priority if self.max_priority is None else self.max_priority
        return min(wanted, ceiling)

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models


OPEN = Tenant("anonymous")  # every request when no keys are configured


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The configured tenants; ``find(key)`` is the tenant a key belongs to."""

    def __init__(self, keys: dict[str, Tenant] | None = None):
        # sha256(key) -> tenant; the keys themselves are not kept
        self._by_digest = [(_digest(k), t) for k, t in (keys or {}).items()]

    @property
    def open(self) -> bool:
        """No keys configured: anyone who reaches the port may call the API."""
        return not self._by_digest

    def find(self, key: str | None) -> Tenant | None:
        if key is None:
            return None
        presented = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._by_digest:  # every entry, so timing says nothing
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def names(self) -> list[str]:
        return sorted({t.name for _, t in self._by_digest})


def load_tenants(path: Path | None) -> Tenants:
    """Read the tenants file; ``None``: no tenants (the API is open)."""
    if path is None:
        return Tenants()
    try:
        raw = yaml.safe_load(path.read_text())
        spec = _TenantsFile.model_validate(raw)
    except OSError as exc:
        raise ConfigError(f"cannot read the tenants file {path}: {exc.strerror}") from exc
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"the tenants file {path} is not valid: {type(exc).__name__}") from exc
    keys: dict[str, Tenant] = {}
    for name, t in spec.tenants.items():
        if t.max_priority is not None and t.max_priority < t.priority:
            raise ConfigError(
                f"the tenants file {path}: a tenant's max_priority is below its priority"
            )
        tenant = Tenant(
            name,
            t.priority,
            t.requests_per_minute,
            t.tokens_per_minute,
            t.max_concurrency,
            frozenset(t.models),
            t.max_priority,
        )
        for key in t.keys:
            if key in keys:
                raise ConfigError(f"the tenants file {path} gives one key to two tenants")
            keys[key] = tenant
    return Tenants(keys)


@dataclass(slots=True)
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # start times
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (end time, tokens)
    token_sum: int = 0
    in_flight: int = 0


class TenantLimits:
    """Per-tenant counters over a sliding minute, and requests in flight."""

    def __init__(self, window_s: float = WINDOW_S):
        self._window_s = window_s
        self._usage: dict[str, _Usage] = {}

    def _get(self, tenant: Tenant, now: float) -> _Usage:
        usage = self._usage.setdefault(tenant.name, _Usage())
        horizon = now - self._window_s
        while usage.requests and usage.requests[0] <= horizon:
            usage.requests.popleft()
        while usage.tokens and usage.tokens[0][0] <= horizon:
            usage.token_sum -= usage.tokens.popleft()[1]
        return usage

    def in_flight(self, name: str) -> int:
        """Requests of the tenant called ``name`` in flight now."""
        usage = self._usage.get(name)
        return usage.in_flight if usage else 0

    def check(self, tenant: Tenant, now: float | None = None) -> tuple[str, float] | None:
        """``None`` if one more request may start; else ``(which limit, retry after s)``."""
        now = time.monotonic() if now is None else now
        usage = self._get(tenant, now)
        if tenant.max_concurrency is not None and usage.in_flight >= tenant.max_concurrency:
            return "max_concurrency", 1.0
        rpm = tenant.requests_per_minute
        if rpm is not None and len(usage.requests) >= rpm:
            return "requests_per_minute", max(0.0, usage.requests[0] + self._window_s - now)
        tpm = tenant.tokens_per_minute
        if tpm is not None and usage.token_sum >= tpm:
            return "tokens_per_minute", max(0.0, usage.tokens[0][0] + self._window_s - now)
        return None

    def started(self, tenant: Tenant, now: float | None = None) -> float:
        """Count one request from now on (in flight, and in the minute); returns its stamp.
        Call it right after :meth:`check`, with no wait between, so that requests checked
        together cannot pass a limit together."""
        now = time.monotonic() if now is None else now
        usage = self._get(tenant, now)
        usage.requests.append(now)
        usage.in_flight += 1
        return now

    def withdrawn(self, tenant: Tenant, stamp: float) -> None:
        """A request counted by :meth:`started` never ran (refused or left while queued):
        it uses none of the tenant's limits."""
        usage = self._get(tenant, time.monotonic())
        usage.in_flight = max(0, usage.in_flight - 1)
        with contextlib.suppress(ValueError):
            usage.requests.remove(stamp)

    def finished(self, tenant: Tenant, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        usage = self._get(tenant, now)
        usage.in_flight = max(0, usage.in_flight - 1)
        if tokens > 0:
            usage.tokens.append((now, tokens))
            usage.token_sum += tokens

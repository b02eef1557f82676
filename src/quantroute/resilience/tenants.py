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

A fleet keeps its tenants in etcd instead (``cluster/``, docs/cluster.md): one
:class:`TenantRecord` per tenant, the same fields with the keys as sha256 digests
(``keys_sha256``), and :meth:`Tenants.replace` swaps them in whole. A gateway that has
had tenants never opens its API at runtime: with every tenant gone, no key is valid.

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
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantroute.errors import ConfigError

__all__ = ["OPEN", "Tenant", "TenantLimits", "TenantRecord", "Tenants", "load_tenants"]

WINDOW_S = 60.0


class _Limits(BaseModel):
    """A tenant's priority, limits and models: the tenants file's fields and etcd's."""

    model_config = ConfigDict(extra="forbid")

    priority: int = Field(0, ge=-10, le=10)
    max_priority: int | None = Field(None, ge=-10, le=10)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrency: int | None = Field(None, ge=1)
    models: list[str] = Field(default_factory=lambda: ["*"])

    def tenant(self, name: str) -> Tenant:
        if self.max_priority is not None and self.max_priority < self.priority:
            raise ValueError("a tenant's max_priority is below its priority")
        return Tenant(
            name,
            self.priority,
            self.requests_per_minute,
            self.tokens_per_minute,
            self.max_concurrency,
            frozenset(self.models),
            self.max_priority,
        )


class _TenantSpec(_Limits):
    keys: list[str] = Field(min_length=1)


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class TenantRecord(_Limits):
    """A tenant as etcd keeps it (``/<cluster>/tenants/<name>``): the tenants file's fields,
    with each key's sha256 (lower-case hex) in ``keys_sha256`` instead of the key.

    >>> import hashlib
    >>> digest = hashlib.sha256(b"sk-acme-1").hexdigest()
    >>> t, keys = TenantRecord.model_validate({"keys_sha256": [digest]}).entries("acme")
    >>> t.name, len(keys[0])
    ('acme', 32)
    """

    keys_sha256: list[str] = Field(min_length=1, max_length=64)

    def entries(self, name: str) -> tuple[Tenant, tuple[bytes, ...]]:
        """The tenant and its keys' digests; ``ValueError`` says what is wrong."""
        for digest in self.keys_sha256:
            if not _SHA256_HEX.match(digest):
                raise ValueError("keys_sha256 holds lower-case hex sha256 digests (64 digits)")
        return self.tenant(name), tuple(bytes.fromhex(d) for d in self.keys_sha256)


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


Entries = tuple[tuple[bytes, Tenant], ...]  # (sha256 of a key, its tenant)


@dataclass(frozen=True, slots=True)
class _Keys:
    by_digest: Entries
    open: bool


class Tenants:
    """The configured tenants; ``find(key)`` is the tenant a key belongs to."""

    def __init__(self, keys: dict[str, Tenant] | None = None):
        # sha256(key) -> tenant; the keys themselves are not kept
        entries = tuple((_digest(k), t) for k, t in (keys or {}).items())
        self._keys = _Keys(entries, open=not entries)

    @property
    def open(self) -> bool:
        """No keys configured: anyone who reaches the port may call the API."""
        return self._keys.open

    def find(self, key: str | None) -> Tenant | None:
        if key is None:
            return None
        presented = _digest(key)
        found: Tenant | None = None
        for digest, tenant in self._keys.by_digest:  # every entry, so timing says nothing
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def names(self) -> list[str]:
        return sorted({t.name for _, t in self._keys.by_digest})

    def entries(self) -> Entries:
        """Every (key digest, tenant): what :meth:`replace` takes."""
        return self._keys.by_digest

    def replace(self, entries: Sequence[tuple[bytes, Tenant]]) -> None:
        """Serve ``entries`` from now on: one assignment, so a request sees the old tenants
        or the new. An open API closes when tenants come; a closed one never opens again
        (with no entries left, no key is valid): a deleted record must not open the API."""
        self._keys = _Keys(tuple(entries), open=self._keys.open and not entries)


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
        try:
            tenant = t.tenant(name)
        except ValueError as exc:
            raise ConfigError(f"the tenants file {path}: {exc}") from exc
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


class Limits(Protocol):
    """What the gateway asks of the tenants' limits: this process's counts
    (:class:`TenantLimits`) or the fleet's, shared through Redis
    (``cluster/redis_limits.py``)."""

    def in_flight(self, name: str) -> int: ...

    async def admit(self, tenant: Tenant) -> tuple[tuple[str, float] | None, float]: ...

    def withdrawn(self, tenant: Tenant, stamp: float) -> None: ...

    def finished(self, tenant: Tenant, tokens: int, now: float | None = None) -> None: ...


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

    async def admit(self, tenant: Tenant) -> tuple[tuple[str, float] | None, float]:
        """:meth:`check` then :meth:`started`, in one step (a fleet's limits check and count
        in one Redis round trip: ``cluster/redis_limits.py``): ``(None, stamp)`` once
        counted, else ``((which limit, retry after s), 0.0)``."""
        over = self.check(tenant)
        if over is not None:
            return over, 0.0
        return None, self.started(tenant)

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

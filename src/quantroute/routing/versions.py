"""Versions of a model and the traffic rules that choose one per request.

A model whose manifest declares versions is served as one route per version,
``tiny-llama@v1``, ``tiny-llama@v2``; a request for ``tiny-llama`` gets the
version the rules pick, one for ``tiny-llama@v2`` gets v2 (pinned). Rules, in
the manifest's order:

- a header rule (``header: x-ab-group, value: b``) sends every request that
  carries that header value to its version: an A/B group the client picks;
- percent rules share the users out by a stable hash of the user (the body's
  ``user`` field, else the ``x-quantroute-user`` header): the hash of a user
  falls in one of 10,000 buckets, the first ``10 %`` of them go to the first
  percent rule's version, the next ones to the next rule's. The same user
  always lands in the same bucket, so a user sticks to a version for as long
  as the rules stay the same, across restarts and gateways.

A request that matches no rule (no header, no user, or a user past the
percentages) gets the default version. Rolling back is editing the manifest.

>>> split = VersionSplit("m", "v1", (Rule("v2", percent=10.0),))
>>> split.pick(Audience(user="alice"))  in ("v1", "v2")
True
>>> split.pick(Audience()) # no user: the default
'v1'
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from quantroute.types import versioned_name

USER_HEADER = "x-quantroute-user"
VERSION_HEADER = "x-quantroute-version"
BUCKETS = 10_000


@dataclass(frozen=True, slots=True)
class Audience:
    """Who a request is from, as the rules see it: its user, and its headers
    (lower-case names)."""

    user: str | None = None
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, user: str | None, headers: Mapping[str, str]) -> Audience:
        """The body's ``user`` first, else the ``x-quantroute-user`` header."""
        return cls(user or headers.get(USER_HEADER) or None, headers)


@dataclass(frozen=True, slots=True)
class Rule:
    version: str
    percent: float | None = None
    header: str | None = None  # lower-case
    value: str | None = None


def user_bucket(model: str, user: str) -> int:
    """The user's bucket for ``model``, in ``[0, BUCKETS)``: stable everywhere (sha256,
    not Python's salted ``hash``), and independent between models."""
    digest = hashlib.sha256(f"{model}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


@dataclass(frozen=True, slots=True)
class VersionSplit:
    """A model's versions and rules; ``pick`` is pure."""

    model: str
    default: str
    rules: tuple[Rule, ...] = ()
    versions: tuple[str, ...] = ()

    def pick(self, who: Audience) -> str:
        for rule in self.rules:
            if rule.header is not None and who.headers.get(rule.header) == rule.value:
                return rule.version
        if who.user is None:
            return self.default
        bucket = user_bucket(self.model, who.user)
        edge = 0.0
        for rule in self.rules:
            if rule.percent is not None:
                edge += rule.percent * BUCKETS / 100.0
                if bucket < edge:
                    return rule.version
        return self.default

    def route_name(self, version: str) -> str:
        return versioned_name(self.model, version)

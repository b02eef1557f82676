"""The route table: an immutable snapshot of models and their branches.

Built whole and swapped by reference (``RouteTableRef.current = new``);
readers take ``ref.current`` once per request and never lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from quantroute.types import Precision

if TYPE_CHECKING:
    from collections.abc import Mapping

    from quantroute.engines.base import Engine
    from quantroute.quality.profile import BranchProfile
    from quantroute.registry.manifest import BranchArtifact


@dataclass(frozen=True, slots=True)
class Branch:
    model: str
    name: str
    precision: Precision
    artifact: BranchArtifact
    engine: Engine
    profile: BranchProfile | None = None  # measured quality and speed of this exact file

    @property
    def id(self) -> str:
        return f"{self.model}:{self.name}"


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str
    reference: str
    branches: tuple[Branch, ...]  # reference first, then by precision rank
    profile_warnings: tuple[str, ...] = ()  # why a branch has no valid profile

    def branch(self, name: str) -> Branch | None:
        return next((b for b in self.branches if b.name == name), None)


@dataclass(frozen=True, slots=True)
class RouteTable:
    models: Mapping[str, ModelRoute] = field(default_factory=lambda: MappingProxyType({}))
    version: int = 0

    @classmethod
    def build(cls, routes: list[ModelRoute], version: int = 0) -> RouteTable:
        return cls(MappingProxyType({r.name: r for r in routes}), version)

    def branches(self) -> list[Branch]:
        return [b for route in self.models.values() for b in route.branches]


class RouteTableRef:
    """Holds the current table. Assignment of a reference is atomic in CPython."""

    def __init__(self, table: RouteTable):
        self.current = table

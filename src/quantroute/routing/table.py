"""The route table: an immutable snapshot of models and their branches.

Built whole and swapped by reference (``RouteTableRef.current = new``);
readers take ``ref.current`` once per request and never lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from quantroute.errors import NotFoundError
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

    def by_id(self, branch_ids: tuple[str, ...]) -> tuple[Branch, ...]:
        """The branches of a decision, in its order."""
        index = {b.id: b for b in self.branches}
        return tuple(index[i] for i in branch_ids)


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


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """``"m"`` → ``("m", None)``; ``"m:b"`` → ``("m", "b")``."""
    model, sep, branch = ref.partition(":")
    return model, (branch if sep else None)


def lookup(table: RouteTable, ref: str) -> tuple[ModelRoute, Branch | None]:
    """The model a request names, and its pinned branch if it names one (``m:b``).
    An unknown model or branch is a 404 that lists what is served, never a default."""
    name, pinned = parse_model_ref(ref)
    route = table.models.get(name)
    if route is None:
        known = ", ".join(sorted(table.models)) or "none"
        raise NotFoundError(
            f"The requested model does not exist. Models served here: {known}.", param="model"
        )
    if pinned is None:
        return route, None
    branch = route.branch(pinned)
    if branch is None:
        raise NotFoundError(
            f"The model {name} has no such branch; its branches are "
            + ", ".join(b.name for b in route.branches)
            + ".",
            param="model",
        )
    return route, branch

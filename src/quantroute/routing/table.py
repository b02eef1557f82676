"""The route table: an immutable snapshot of models and their branches.

Built whole and swapped by reference (``RouteTableRef.current = new``);
readers take ``ref.current`` once per request and never lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from quantroute.errors import NotFoundError
from quantroute.routing.versions import Audience, VersionSplit
from quantroute.types import Precision, split_version

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

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
    id: str = field(init=False, repr=False, compare=False)  # model:name, made once

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", f"{self.model}:{self.name}")

    @property
    def version(self) -> str | None:
        """The model version this branch belongs to (``m@v2`` → ``v2``), if any."""
        return split_version(self.model)[1]

    @property
    def draft(self) -> str | None:
        """The branch id of the draft its engine speculates with (a reference whose worker
        loaded one: ``engines/llamacpp/draft.py``); ``None`` when it drafts nothing."""
        info = self.engine.info
        return info.draft if info is not None else None


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str
    reference: str
    branches: tuple[Branch, ...]  # reference first, then by precision rank
    profile_warnings: tuple[str, ...] = ()  # why a branch has no valid profile
    stale: frozenset[str] = frozenset()  # branches whose profile measured a replaced file

    @property
    def model(self) -> str:
        """The model a client names: ``m`` for the route ``m@v2``."""
        return split_version(self.name)[0]

    @property
    def version(self) -> str | None:
        return split_version(self.name)[1]

    def branch(self, name: str) -> Branch | None:
        return next((b for b in self.branches if b.name == name), None)

    def by_id(self, branch_ids: tuple[str, ...]) -> tuple[Branch, ...]:
        """The branches of a decision, in its order."""
        index = {b.id: b for b in self.branches}
        return tuple(index[i] for i in branch_ids)


@dataclass(frozen=True, slots=True)
class RouteTable:
    models: Mapping[str, ModelRoute] = field(default_factory=lambda: MappingProxyType({}))
    version: int = 0  # the generation: one more at every reload that changed something
    splits: Mapping[str, VersionSplit] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def build(
        cls, routes: list[ModelRoute], version: int = 0, splits: list[VersionSplit] | None = None
    ) -> RouteTable:
        """``routes`` by name; a versioned model's routes are named ``model@version`` and
        its ``VersionSplit`` picks one for a request that names the model alone."""
        by_model = MappingProxyType({s.model: s for s in splits or ()})
        return cls(MappingProxyType({r.name: r for r in routes}), version, by_model)

    def serves(self, ref: str) -> bool:
        """Whether ``ref`` (``m``, ``m@v2``, ``m:b``) names a model served here."""
        name = parse_model_ref(ref)[0]
        return name in self.models or name in self.splits

    def names(self) -> list[str]:
        """What a client may name: plain models, versioned models and their versions."""
        return sorted({*self.models, *self.splits})

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


def lookup(
    table: RouteTable,
    ref: str,
    who: Audience | None = None,
    may_use: Callable[[str], bool] | None = None,
) -> tuple[ModelRoute, Branch | None]:
    """The model a request names, and its pinned branch if it names one (``m:b``).
    A versioned model's version is ``who``'s by its rules (``m``), or pinned
    (``m@v2``, ``m@v2:b``). An unknown model, version or branch is a 404 that lists
    what is served, never a default. With ``may_use`` (a tenant's: which models its key
    may use) a model it may not use is a 404 like an unknown one, and the lists name
    only the models it may use: nothing about another tenant's models shows."""
    name, pinned = parse_model_ref(ref)
    if may_use is not None and not may_use(split_version(name)[0]):
        raise NotFoundError(_not_served(table, may_use), param="model")
    split = table.splits.get(name)
    if split is not None:
        name = split.route_name(split.pick(who or Audience()))
    route = table.models.get(name)
    if route is None:
        base, version = split_version(name)
        split = table.splits.get(base)
        if split is not None and version:
            raise NotFoundError(
                f"The model {base} has no such version; its versions are "
                + ", ".join(split.versions)
                + ".",
                param="model",
            )
        raise NotFoundError(_not_served(table, may_use), param="model")
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


def _not_served(table: RouteTable, may_use: Callable[[str], bool] | None) -> str:
    names = table.names()
    if may_use is None:
        return f"The requested model does not exist. Models served here: {_listed(names)}."
    names = [n for n in names if may_use(split_version(n)[0])]
    return (
        "The requested model does not exist, or this key may not use it. "
        f"Models this key may use: {_listed(names)}."
    )


def _listed(names: list[str]) -> str:
    return ", ".join(names) or "none"

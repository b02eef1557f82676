"""Which branch answers a request.

This first policy picks the highest-precision ready branch and keeps the
others, in order, as fallbacks; a pinned branch (``tiny-llama:q4_k_m``)
answers alone. The accuracy/deadline/memory policy replaces it (issue:
the router) behind the same ``choose`` signature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quantroute.errors import NotFoundError, ServiceUnavailableError
from quantroute.routing.table import Branch, RouteTable

RETRY_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class Decision:
    model: str
    branches: tuple[Branch, ...]  # primary first, then fallbacks
    reason: str
    pinned: bool


def parse_model_ref(ref: str) -> tuple[str, str | None]:
    """``"m"`` → ``("m", None)``; ``"m:b"`` → ``("m", "b")``."""
    model, sep, branch = ref.partition(":")
    return model, (branch if sep else None)


def choose(
    table: RouteTable,
    model_ref: str,
    *,
    degraded: Callable[[str], bool] = lambda branch_id: False,
) -> Decision:
    """The branches to try, in order. ``degraded`` (the drift monitor's verdict)
    moves a branch behind every faithful one: it is still a fallback, never first."""
    name, pinned = parse_model_ref(model_ref)
    route = table.models.get(name)
    if route is None:
        known = ", ".join(sorted(table.models)) or "none"
        raise NotFoundError(
            f"The requested model does not exist. Models served here: {known}.", param="model"
        )
    if pinned is not None:
        branch = route.branch(pinned)
        if branch is None:
            raise NotFoundError(
                f"The model {name} has no such branch; its branches are "
                + ", ".join(b.name for b in route.branches)
                + ".",
                param="model",
            )
        if not branch.engine.ready:
            raise ServiceUnavailableError(
                f"branch {branch.id} is not ready", retry_after_s=RETRY_AFTER_S
            )
        return Decision(name, (branch,), "pinned", True)
    ready = sorted(
        (b for b in route.branches if b.engine.ready),
        key=lambda b: (degraded(b.id), b.precision.spec.rank),
    )
    if not ready:
        raise ServiceUnavailableError(f"no branch of {name} is ready", retry_after_s=RETRY_AFTER_S)
    reason = "degraded-branch-only" if degraded(ready[0].id) else "highest-precision-ready"
    return Decision(name, tuple(ready), reason, False)

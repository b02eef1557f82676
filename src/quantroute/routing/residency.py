"""Which branches should be loaded, as device memory changes. Pure and table-tested;
the gateway carries the plan out (stops and starts workers) once per device reading.

Rules, per device, in order:

1. **Never past the budget.** On a device whose free-for-routing memory is
   below zero, the loaded branches are kept in order of value (recent request
   rate, then recency; among the cold, the smaller first, so that more stay)
   as long as they fit in what the device can give its branches; the rest are
   unloaded. A model left with nothing
   keeps (or loads) its most faithful branch that still fits, else its
   smallest loaded one.
2. **Every model keeps a branch.** A model with nothing loaded gets its
   cheapest branch that fits.
3. **Reload when there is room.** An unloaded branch is loaded again when its
   device has its footprint plus ``reload_margin_bytes`` free (hysteresis, so a
   branch does not flap at the edge), the most faithful first, one per device
   per reading.

A branch that is loaded takes traffic only after its warm-up (the gateway's
business: it routes to warm branches only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResidentBranch:
    id: str
    model: str
    device: str
    footprint_bytes: int
    loaded: bool  # running or starting
    rank: int  # precision rank: 0 is the most faithful
    heat: float = 0.0  # recent requests per second
    last_used: float = 0.0  # monotonic time of the last request; 0: never


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    unload: tuple[str, ...] = ()
    load: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def _size(b: ResidentBranch) -> tuple[int, int]:
    return (b.footprint_bytes, -b.rank)


def plan_residency(
    branches: Sequence[ResidentBranch],
    headroom: Mapping[str, int],  # device id -> free-for-routing bytes now
    *,
    reload_margin_bytes: int,
) -> ResidencyPlan:
    free = dict(headroom)
    loaded_per_model: dict[str, int] = {}
    for b in branches:
        if b.loaded:
            loaded_per_model[b.model] = loaded_per_model.get(b.model, 0) + 1
    unload: list[str] = []
    load: list[str] = []
    for device in sorted({b.device for b in branches if b.loaded}):  # rule 1
        if free.get(device, 0) >= 0:
            continue
        here = [b for b in branches if b.device == device]
        loaded = [b for b in here if b.loaded]
        room = free.get(device, 0) + sum(b.footprint_bytes for b in loaded)
        kept: list[ResidentBranch] = []
        # hot first; among the cold, small first: more branches stay loaded
        for b in sorted(loaded, key=lambda b: (-b.heat, -b.last_used, b.footprint_bytes)):
            if b.footprint_bytes <= room:
                kept.append(b)
                room -= b.footprint_bytes
        for model in sorted({b.model for b in loaded} - {b.model for b in kept}):
            fitting = sorted(
                (b for b in here if b.model == model and b.footprint_bytes <= room),
                key=lambda b: (b.rank, b.footprint_bytes),
            )
            if fitting:
                chosen = fitting[0]
                room -= chosen.footprint_bytes
                if not chosen.loaded:
                    load.append(chosen.id)
                    loaded_per_model[model] += 1
            else:  # nothing fits: keep the smallest, and say so by failing its requests
                chosen = min((b for b in loaded if b.model == model), key=_size)
            kept.append(chosen)
        for b in loaded:
            if b not in kept:
                unload.append(b.id)
                loaded_per_model[b.model] -= 1
        free[device] = room
    for model in sorted({b.model for b in branches}):  # rule 2
        if loaded_per_model.get(model, 0):
            continue
        candidates = sorted(
            (b for b in branches if b.model == model and not b.loaded and b.id not in unload),
            key=lambda b: (b.footprint_bytes, b.rank),
        )
        for b in candidates:
            if free.get(b.device, 0) >= b.footprint_bytes:
                load.append(b.id)
                loaded_per_model[model] = 1
                free[b.device] -= b.footprint_bytes
                break
    devices_loading = {b.device for b in branches if b.id in load}
    for b in sorted(branches, key=lambda b: (b.rank, b.footprint_bytes)):  # rule 3
        if b.loaded or b.id in load or b.id in unload or b.device in devices_loading:
            continue
        if free.get(b.device, 0) >= b.footprint_bytes + reload_margin_bytes:
            load.append(b.id)
            devices_loading.add(b.device)
            free[b.device] -= b.footprint_bytes
    return ResidencyPlan(tuple(unload), tuple(load))

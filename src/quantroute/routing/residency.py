"""Which branches should be loaded, as device memory changes. Pure and table-tested;
the gateway carries the plan out (stops and starts workers) once per device reading.

Rules, per device, in order:

1. **Never past the budget.** When a device's free-for-routing memory is below
   zero, its loaded branches are unloaded, coldest first (lowest heat, then
   least recently used, then the most expensive), until it is not — except each
   model's cheapest loaded branch, its survivor (the one most likely to fit).
   If the device is still over budget, a survivor is swapped for the most
   faithful smaller branch of its model that fits.
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


def _cheaper(a: ResidentBranch, b: ResidentBranch) -> bool:
    return (a.footprint_bytes, -a.rank) < (b.footprint_bytes, -b.rank)


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
    survivor: dict[str, ResidentBranch] = {}
    for b in branches:
        if b.loaded and (b.model not in survivor or _cheaper(b, survivor[b.model])):
            survivor[b.model] = b
    coldest_first = sorted(
        (b for b in branches if b.loaded),
        key=lambda b: (b.heat, b.last_used, -b.footprint_bytes, -b.rank),
    )
    for b in coldest_first:  # rule 1
        if free.get(b.device, 0) >= 0 or survivor[b.model] is b:
            continue
        unload.append(b.id)
        loaded_per_model[b.model] -= 1
        free[b.device] = free.get(b.device, 0) + b.footprint_bytes
    for b in sorted(survivor.values(), key=lambda b: -b.footprint_bytes):  # rule 1, swaps
        if free.get(b.device, 0) >= 0:
            continue
        room = free.get(b.device, 0) + b.footprint_bytes
        smaller = sorted(
            (
                c
                for c in branches
                if c.model == b.model
                and not c.loaded
                and c.device == b.device
                and c.footprint_bytes < b.footprint_bytes
                and c.footprint_bytes <= room
            ),
            key=lambda c: (c.rank, c.footprint_bytes),
        )
        if smaller:
            unload.append(b.id)
            load.append(smaller[0].id)
            free[b.device] = room - smaller[0].footprint_bytes
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

"""A finishing drain forgets a removed id's placement only between reloads: never while a
reload that brings the id back is placing and starting its new worker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from quantroute.api.drain import Drains


class _Engine:
    in_flight = 0

    async def stop(self) -> None:
        pass


async def test_a_drain_keeps_the_placement_of_an_id_a_running_reload_brings_back() -> None:
    placements: dict[str, str] = {}
    served: list[SimpleNamespace] = []  # reload 1 removed m:x: the table serves nothing
    routes = SimpleNamespace(current=SimpleNamespace(branches=lambda: served))

    def forget(branch_id: str) -> None:  # the gateway's: the id's placement goes
        placements.pop(branch_id, None)

    lock = asyncio.Lock()  # the reloads'
    drains = Drains(routes, forget, quiet_s=0.05, timeout_s=5.0, lock=lock)  # type: ignore[arg-type]
    old = SimpleNamespace(id="m:x", engine=_Engine())
    async with lock:  # reload 2: places the new m:x, starts its worker, swaps it in
        task = drains.spawn(drains.drain([old]))  # type: ignore[list-item]
        placements["m:x"] = "the new worker's"
        await asyncio.sleep(0.3)  # drain 1's quiet time ends while reload 2 works
        served.append(SimpleNamespace(id="m:x"))  # the swap
    await task
    assert placements == {"m:x": "the new worker's"}
    # with no reload bringing it back, a removed id's placement goes
    placements["m:y"] = "the old worker's"
    await drains.drain([SimpleNamespace(id="m:y", engine=_Engine())])  # type: ignore[list-item]
    assert "m:y" not in placements

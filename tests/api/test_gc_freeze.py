"""``quantroute serve`` freezes the started gateway's heap out of the collector's sight
(``app.freeze_startup_heap``); an app made without it (tests, embedders) leaves the
collector alone. A real uvicorn on a real socket."""

from __future__ import annotations

import gc

import httpx

from qrtest import fake_app, live


def _seen_by_the_collector(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())  # every generation but the frozen one


async def test_a_served_app_freezes_what_it_started_with_and_thaws_it_on_shutdown() -> None:
    assert gc.get_freeze_count() == 0
    app = fake_app(freeze_gc=True)
    gateway = app.state.gateway
    async with live(app) as port, httpx.AsyncClient(timeout=30) as client:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the modules, the tables, the engines, the schemas
        assert not _seen_by_the_collector(gateway)
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 8, "stream": True}
        r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        garbage = [[]]
        garbage[0].append(garbage)  # a cycle made while serving: collected as ever
        assert _seen_by_the_collector(garbage)
        # once, at the start (fewer since: a frozen object is freed when its last reference goes)
        assert gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0 and _seen_by_the_collector(gateway)


async def test_an_app_made_without_it_leaves_the_collector_alone() -> None:
    app = fake_app()
    async with live(app):
        assert gc.get_freeze_count() == 0
        assert _seen_by_the_collector(app.state.gateway)

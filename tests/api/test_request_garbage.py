"""A request's objects are freed as it ends, by reference counting, not left in cycles for
the garbage collector: every collection pauses the event loop and every stream with it
(docs/benchmarks.md, "A request's own cost, with the prompt cache on"). The real app on
real llama.cpp workers (the engine whose streams hand tokens over inline), a real socket."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from qrtest import live
from quantroute.api.app import create_app
from quantroute.config import DEMO_REPO, load_settings
from quantroute.resilience.resume import StreamStore

pytestmark = pytest.mark.slow

COMPLETION = {"model": "tiny-llama:q8_0", "prompt": "def ", "max_tokens": 6}
CHAT = {"model": "tiny-llama:q8_0", "messages": [{"role": "user", "content": "hi"}]}
REQUESTS = [
    ("/v1/completions", COMPLETION | {"stream": True}),
    ("/v1/completions", COMPLETION | {"stream": True, "n": 2}),
    ("/v1/completions", COMPLETION | {"stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", COMPLETION),
    ("/v1/chat/completions", CHAT | {"max_tokens": 6, "stream": True}),
    ("/v1/chat/completions", CHAT | {"max_tokens": 6}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
]


@contextmanager
def cyclic_garbage() -> Iterator[list[object]]:
    """What the collector finds unreachable, collected at the end (a list filled then)."""
    found: list[object] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_requests_of_every_kind_leave_none_of_their_objects_in_cycles() -> None:
    app = create_app(load_settings(repo=DEMO_REPO, engine={"parallel": 2, "n_threads": 1}))
    async with live(app) as port, httpx.AsyncClient(timeout=60) as client:
        base = f"http://127.0.0.1:{port}"
        for path, body in REQUESTS:  # once first: what a first request builds lives on
            await client.post(base + path, json=body)
        with cyclic_garbage() as garbage:
            for _ in range(3):
                for path, body in REQUESTS:
                    r = await client.post(base + path, json=body)
                    assert r.status_code == (404 if body["model"] == "no-such-model" else 200)
                await _leave_a_stream(client, base, app.state.streams)
    ours = sorted(
        {type(o).__qualname__ for o in garbage if type(o).__module__.startswith("quantroute")}
    )
    assert ours == []


async def _leave_a_stream(client: httpx.AsyncClient, base: str, store: StreamStore) -> None:
    """Read a long stream's first chunk, leave, and wait for its producer to end."""
    body = COMPLETION | {"max_tokens": 200, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            break
    for _ in range(1000):
        await asyncio.sleep(0.01)
        if all(stream.done for stream in store._streams.values()):
            return
    raise AssertionError("the stream the client left did not end")

"""``GET /metrics`` after real requests through the real app: counted families, scrape-time
families, and ``promtool check metrics`` on the exposition."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qrtest import fake_app, serving
from quantroute.engines.fake import FakeEngine
from tools import need_tool

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def exported_names(text: str) -> set[str]:
    """Every series name the exposition declares (``# TYPE``), samples or not yet."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"histogram": ("_bucket", "_sum", "_count", "_created")}.get(kind, ("",))
            names.update(name + suffix for suffix in suffixes)
    return names


async def test_requests_tokens_latency_routing_and_fallbacks_are_counted() -> None:
    app = fake_app()
    async with serving(app) as (client, gateway):
        body = {"model": "tiny-llama", "prompt": "def f():", "max_tokens": 5, "quality": "fast"}
        first = await client.post("/v1/completions", json=body)
        assert first.status_code == 200
        chosen = first.headers["x-quantroute-branch"].partition(":")[2]
        stream = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 7,
                "stream": True,
                "quality": "fast",
            },
        )
        assert stream.status_code == 200
        assert (
            await client.post("/v1/completions", json=body | {"model": "nope"})
        ).status_code == 404
        # the first choice refuses before its first token: the request falls back
        engine = gateway.routes.current.models["tiny-llama"].branch(chosen).engine
        assert isinstance(engine, FakeEngine)
        engine.faults.refuse = True
        fell = await client.post("/v1/completions", json=body)
        assert fell.status_code == 200
        to = fell.headers["x-quantroute-branch"].partition(":")[2]
        assert to != chosen
        scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    s = _samples(scrape.text)
    ok = {"model": "tiny-llama", "tenant": "anonymous"}
    assert _value(s, "quantroute_requests_total", status="200", **ok) == 3
    assert _value(s, "quantroute_requests_total", model="none", branch="none", status="404") == 1
    assert _value(s, "quantroute_completion_tokens_total", **ok) == 5 + 7 + 5
    assert _value(s, "quantroute_prompt_tokens_total", branch=chosen, **ok) > 0
    assert _value(s, "quantroute_time_to_first_token_seconds_count", model="tiny-llama") == 3
    # every streamed token after the first is a gap: 4 + 6 + 4
    assert _value(s, "quantroute_inter_token_latency_seconds_count", model="tiny-llama") == 14
    assert _value(s, "quantroute_request_duration_seconds_count", status="200") == 3
    assert _value(s, "quantroute_queue_wait_seconds_count", model="tiny-llama") == 3
    assert _value(s, "quantroute_routing_decisions_total", model="tiny-llama") == 3
    fallback = {"model": "tiny-llama", "from": chosen, "to": to}
    assert _value(s, "quantroute_fallback_total", reason="engine_unavailable", **fallback) == 1
    # scrape-time families
    names = exported_names(scrape.text)
    for name in (
        "quantroute_branch_breaker_state",
        "quantroute_device_used_bytes",
        "quantroute_device_utilization_ratio",
        "quantroute_queue_depth",
        "quantroute_model_running_requests",
    ):
        assert name in names, name
    assert _value(s, "quantroute_branch_breaker_state", branch=chosen, state="closed") == 1
    assert _value(s, "quantroute_device_total_bytes", device="sim:0") == 24 * 2**30


async def test_worker_restarts_hot_reloads_and_prompt_cache_families() -> None:
    app = fake_app()
    async with serving(app) as (client, gateway):
        branch = gateway.routes.current.models["tiny-llama"].branches[0]
        gateway.engine_exited(branch.engine, -9)
        gateway.observer.hot_reload("applied")
        gateway.observer.prompt_cache_hit("tiny-llama", "q8_0", 12)
        with pytest.raises(ValueError):
            gateway.observer.hot_reload("maybe")
        s = _samples((await client.get("/metrics")).text)
    assert _value(s, "quantroute_worker_restarts_total", branch=branch.name) == 1
    assert _value(s, "quantroute_hot_reloads_total", outcome="applied") == 1
    assert _value(s, "quantroute_prompt_cache_hit_tokens_total", branch="q8_0") == 12


async def test_promtool_accepts_the_exposition() -> None:
    promtool = need_tool("promtool", "prometheus")
    app = fake_app()
    async with serving(app) as (client, _):
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    argv = [promtool, "check", "metrics"]
    done = await asyncio.to_thread(
        subprocess.run, argv, input=text, capture_output=True, text=True, timeout=60
    )
    # promtool prints lint findings (naming, units, help) and exits 1 on any
    assert done.returncode == 0, done.stdout + done.stderr


async def test_a_stream_the_client_leaves_counts_the_tokens_it_used() -> None:
    """A client that hangs up mid-stream (a real socket): its request is a 499, and its
    prompt and the tokens it was sent are counted, as its first token and its cache hits
    already were; before, only a choice's finish counted tokens, so it counted none."""
    from qrtest import fake_table, live
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    engine = FakeEngine(text="x" * 400, token_delay_s=0.005)
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"})
    app = create_app(settings, fake_table({"f16": engine}))
    body = {"model": "tiny-llama:f16", "prompt": "def f():", "max_tokens": 300, "stream": True}
    async with live(app) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 5:
                    break  # hang up
        for _ in range(200):
            s = _samples((await http.get("/metrics")).text)
            if _value(s, "quantroute_requests_total", status="499") == 1:
                break
            await asyncio.sleep(0.02)
    assert _value(s, "quantroute_requests_total", status="499") == 1
    prompt = _value(s, "quantroute_prompt_tokens_total", branch="f16")
    sent = _value(s, "quantroute_completion_tokens_total", branch="f16")
    assert prompt == len(body["prompt"]) + 1  # the fake engine: a token per character, and BOS
    assert 5 <= sent < 300, sent  # what it streamed before the hang-up, not max_tokens
    assert app.state.gateway.limits._usage["anonymous"].token_sum == prompt + sent  # the tenant's

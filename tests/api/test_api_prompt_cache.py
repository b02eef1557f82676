"""The prompt cache through the real app on real llama.cpp workers: OpenAI's
``usage.prompt_tokens_details.cached_tokens``, the hit rate per branch in ``/v1/models``,
the Prometheus counter, and the setting that turns it off."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qrtest import demo_model_dir, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = pytest.mark.slow

PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 5


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_model_dir(), root / "tiny-llama")
    return root


async def _complete(client: httpx.AsyncClient, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny-llama:q8_0", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = await client.post("/v1/completions", json=body | extra)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _branch(models: dict[str, Any], branch: str) -> dict[str, Any]:
    entry = next(m for m in models["data"] if m["id"] == "tiny-llama")
    found: dict[str, Any] = next(b for b in entry["branches"] if b["branch"] == branch)
    return found


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def test_cached_tokens_hit_rate_and_metrics(repo: Path) -> None:
    settings = load_settings(repo=repo, engine={"parallel": 2, "n_threads": 1})
    async with serving(create_app(settings)) as (client, _):
        cold = await _complete(client, PREFIX + "a")
        warm = await _complete(client, PREFIX + "b")
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1  # BOS at most
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert len(PREFIX) <= cached < warm["usage"]["prompt_tokens"]
        # n > 1 and a stream: the prompt (and its cached part) is counted once
        two = await _complete(client, PREFIX + "b", n=2, temperature=0.8, seed=3)
        details = two["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] <= two["usage"]["prompt_tokens"]
        async with client.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny-llama:q8_0",
                "prompt": PREFIX + "c",
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        assert '"cached_tokens"' in lines[-1]

        stats = _branch((await client.get("/v1/models")).json(), "q8_0")["prompt_cache"]
        assert stats["enabled"] is True
        assert stats["cached_tokens"] >= cached + len(PREFIX)
        assert 0 < stats["hit_rate"] == stats["cached_tokens"] / stats["prompt_tokens"] < 1
        idle = _branch((await client.get("/v1/models")).json(), "f16")["prompt_cache"]
        assert idle == {"enabled": True, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": None}

        metrics = (await client.get("/metrics")).text
        hits = _counter(metrics, "quantroute_prompt_cache_hit_tokens_total", branch="q8_0")
        assert hits >= cached + len(PREFIX)
        prompts = _counter(metrics, "quantroute_prompt_tokens_total", branch="q8_0")
        assert 0 < hits / prompts < 1


async def test_the_setting_turns_it_off(repo: Path) -> None:
    settings = load_settings(
        repo=repo, engine={"parallel": 2, "n_threads": 1, "prompt_cache": False}
    )
    async with serving(create_app(settings)) as (client, _):
        first = await _complete(client, PREFIX + "a")
        again = await _complete(client, PREFIX + "a")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        stats = _branch((await client.get("/v1/models")).json(), "q8_0")["prompt_cache"]
        assert stats["enabled"] is False and stats["cached_tokens"] == 0
        assert stats["hit_rate"] == 0

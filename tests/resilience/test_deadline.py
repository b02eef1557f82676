"""A deadline travels to the worker, which stops decoding when it passes: the answer keeps
what was generated, with finish_reason "deadline"."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from qrtest import demo_repo_copy, fake_table, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine

LONG = {"prompt": "def ", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.mark.slow
async def test_the_worker_stops_at_the_deadline(tmp_path: Path) -> None:
    settings = load_settings(
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 4096},
        routing={"residency": False},
        drift={"fraction": 0.0},
    )
    async with serving(create_app(settings)) as (client, _):
        body = LONG | {"model": "tiny-llama:q4_k_m"}
        started = time.monotonic()
        r = await client.post(
            "/v1/completions", json=body, headers={"x-quantroute-deadline-ms": "400"}
        )
        elapsed = time.monotonic() - started
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "deadline"
        assert 0 < r.json()["usage"]["completion_tokens"] < 4000 and choice["text"]
        assert elapsed < 1.5  # 4000 tokens would take several seconds here
        # without a deadline the same request runs to its length
        r = await client.post("/v1/completions", json=body | {"max_tokens": 50})
        assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_a_stream_past_its_deadline_ends_cleanly() -> None:
    engines = {n: FakeEngine(token_delay_s=0.01) for n in ("f16", "q8_0", "q4_k_m")}
    app = create_app(load_settings(telemetry={"devices": "sim:1x8GiB"}), table=fake_table(engines))
    async with serving(app) as (client, _):
        r = await client.post(
            "/v1/completions",
            json={
                "model": "tiny-llama:f16",
                "prompt": "x",
                "max_tokens": 500,
                "stream": True,
                "timeout": 0.2,
            },
        )
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert '"finish_reason":"deadline"' in events[-2]


@pytest.mark.slow
async def test_an_out_of_memory_in_the_worker_falls_back_before_the_first_token(
    tmp_path: Path,
) -> None:
    """The reference's worker fails its decodes as llama.cpp does when memory runs out;
    requests move to the next branch, and the worker lives on."""
    settings = load_settings(
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 512, "faults": {"f16": "oom-at-decode"}},
        routing={"residency": False},
        drift={"fraction": 0.0},
        resilience={"breaker_failures": 100},
    )
    async with serving(create_app(settings)) as (client, gateway):
        f16 = gateway.routes.current.models["tiny-llama"].branch("f16")
        assert f16 is not None and f16.engine.ready
        pid = f16.engine.pid
        for _ in range(3):
            r = await client.post(
                "/v1/completions",
                json={"model": "tiny-llama", "prompt": "def ", "max_tokens": 4, "quality": "fast"},
            )
            assert r.status_code == 200 and r.headers["x-quantroute-branch"] != "tiny-llama:f16"
        pinned = await client.post(
            "/v1/completions", json={"model": "tiny-llama:f16", "prompt": "def ", "max_tokens": 4}
        )
        assert pinned.status_code == 503
        assert pinned.json()["error"]["code"] == "device_out_of_memory"
        assert f16.engine.ready and f16.engine.pid == pid  # the worker lives on

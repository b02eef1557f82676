"""Requests with several choices on a full worker never wait on each other: a choice that
has its first token goes on being read while its siblings wait for a slot."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from qrtest import demo_repo_copy, serving
from quantroute.api.app import create_app
from quantroute.config import load_settings

pytestmark = pytest.mark.slow


async def test_more_n_choice_requests_than_slots_all_finish_promptly(tmp_path: Path) -> None:
    settings = load_settings(
        repo=demo_repo_copy(tmp_path),
        engine={"parallel": 2, "n_threads": 1, "n_ctx": 1024},
        routing={"residency": False},
        drift={"fraction": 0.0},
        # a deadlock would show as this timeout, not as a hang of the test
        resilience={"first_token_timeout_s": 20},
    )
    body = {
        "model": "tiny-llama:q4_k_m",
        "prompt": "def ",
        "max_tokens": 200,
        "n": 2,
        "ignore_eos": True,
        "temperature": 0,
    }
    async with serving(create_app(settings)) as (http, _):
        started = time.monotonic()
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))
        took = time.monotonic() - started
    for r in answers:
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["finish_reason"] == "length" for c in choices)
        assert r.json()["usage"]["completion_tokens"] == 400
    assert took < 15, f"{took:.1f} s: requests waited on each other"

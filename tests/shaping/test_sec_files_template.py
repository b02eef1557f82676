"""M1 (issue 32): a model's chat template cannot hold the gateway's event loop.

Templates that were seen to stall ``/healthz`` (the sandbox's own backtracking
regexes, C-level work under the GIL, a budget in characters where emoji are four
bytes) each fail their request with a 400 within the budget, in a render process
the gateway kills, while the loop keeps ticking.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from hostile import loop_gaps
from qrtest import demo_model_dir, live
from quantroute.errors import InvalidRequestError
from quantroute.shaping import template_budget, template_sandbox
from quantroute.shaping.chat_template import render_chat, render_chat_bounded
from quantroute.shaping.template_pool import TemplatePool

MESSAGES = [{"role": "user", "content": "Hi"}]
FORMAT_BOMB = "{{ ('{' ~ ':' * 40000).format() }}"
BOMBS = {
    # the sandbox's own size check backtracked on this: 7.6 s on the loop, then a 500
    "format with 40000 colons": FORMAT_BOMB,
    "percent keys without end": "{{ ('%(' * 40000) % {} }}",
    # 32 MB each, kept: ~960 MB before; now the render process's memory limit
    "emoji multiplication": "{% set ns = namespace(l=[]) %}{% for i in range(30) %}"
    "{% set ns.l = ns.l + [('\U0001f600' * 8000000) ~ i] %}{% endfor %}{{ ns.l|length }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "loop": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "strftime_now with a huge format": "{{ strftime_now('%Y' * 1000000) }}",
    "strftime_now with a huge width": "{{ strftime_now('%999999999Y') }}",
    "a C-level format of many fields": "{{ ('{}' * 4000000).format(*range(10)) }}",
}
TIMEOUT_S = 1.0
SLACK_S = 1.0  # the kill, a busy machine


@pytest.fixture(scope="module")
def pool() -> Any:
    p = TemplatePool(size=2)
    p.warm()  # the first renders do not wait for the processes to start
    yield p
    p.close()


@pytest.mark.parametrize("template", BOMBS.values(), ids=BOMBS.keys())
async def test_a_template_bomb_is_a_400_within_its_budget_and_the_loop_runs(
    pool: TemplatePool, template: str, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, "quantroute.shaping.chat_template"):
        outcome, gap = await loop_gaps(
            render_chat_bounded(
                MESSAGES, model_template=template, timeout_s=TIMEOUT_S, where="m:b", pool=pool
            )
        )
    took = time.monotonic() - start
    assert isinstance(outcome, InvalidRequestError), outcome
    assert outcome.status == 400 and outcome.error_code == "chat_template_limit"
    assert "the model's chat template exceeded its" in outcome.message
    assert took < TIMEOUT_S + SLACK_S
    assert gap < 0.2  # the loop was never held (the format bomb held it 7.6 s)
    assert "of m:b exceeded its" in caplog.text  # the gateway says why, and where
    # the pool renders on (a killed process is replaced)
    prompt = await render_chat_bounded(MESSAGES, model_template="{{ 'ok' * 2 }}", pool=pool)
    assert prompt.text == "okok"


def test_the_sandbox_checks_scan_linearly() -> None:
    for module in (template_sandbox, template_budget):
        assert "import re" not in Path(module.__file__ or "").read_text()  # none backtracks
    start = time.monotonic()
    with pytest.raises(InvalidRequestError):
        render_chat(MESSAGES, model_template=FORMAT_BOMB.replace("40000", "400000"))
    assert time.monotonic() - start < 0.5  # 40000 colons took 7.6 s in the old check


def test_the_budget_counts_utf8_bytes() -> None:
    limits: dict[str, Any] = {"max_chars": 1 << 20, "max_bytes": 1 << 20}
    ascii_ok = render_chat(MESSAGES, model_template="{{ ('a' * 300000)|length }}", **limits)
    assert ascii_ok.text == "300000"
    with pytest.raises(InvalidRequestError, match="size budget"):  # 300K chars, 1.2 MB
        render_chat(MESSAGES, model_template="{{ ('\U0001f600' * 300000)|length }}", **limits)


def test_strftime_now_takes_plain_formats() -> None:
    prompt = render_chat(MESSAGES, model_template="{{ strftime_now('%d %b %Y, %-H:%M') }}")
    assert len(prompt.text) > 10
    for fmt in ("%Y" * 40, "%10Y", "%Ez", "%"):
        with pytest.raises(InvalidRequestError, match="size budget"):
            render_chat(MESSAGES, model_template="{{ strftime_now('" + fmt + "') }}")


_ORPHAN = """
import asyncio, os, sys
from quantroute.shaping.template_pool import TemplatePool
from quantroute.shaping.template_worker import RenderJob
pool = TemplatePool(size=1)
job = RenderJob("{{ 1 }}", [], None, "", "", 5.0, 1000, 1 << 24)
print(asyncio.run(pool.render(job)), *pool.pids, flush=True)
os._exit(0)  # no close, no atexit: the gateway killed
"""


def test_render_processes_end_with_the_gateway() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=60, check=True
    )
    text, pid = done.stdout.split()
    assert text == "1"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(int(pid)):
        time.sleep(0.05)
    assert not _running(int(pid))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie of an init that has not reaped it yet
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    return False


def test_closing_the_pool_kills_its_processes() -> None:
    p = TemplatePool(size=2)
    p.warm()
    pids = p.pids
    assert len(pids) == 2 and all(_running(pid) for pid in pids)
    p.close()
    assert not any(_running(pid) for pid in pids)


# ---- a real server: /healthz stays fast while a template bomb is refused -----------------------


def _repo_with_template(root: Path, template: str) -> Path:
    from quantroute.demo.gguf_export import copy_gguf_with_metadata
    from quantroute.registry.manifest import sha256_file

    model = root / "templated"
    model.mkdir(parents=True)
    gguf = model / "q4_k_m.gguf"
    copy_gguf_with_metadata(
        demo_model_dir() / "q4_k_m.gguf", gguf, {"tokenizer.chat_template": template}
    )
    spec = {"file": "q4_k_m.gguf", "precision": "q4_k_m", "sha256": sha256_file(gguf)}
    manifest = {"model": "templated", "reference": "q4_k_m", "branches": {"q4_k_m": spec}}
    (model / "quantroute.yaml").write_text(yaml.safe_dump(manifest))
    return root


@contextlib.asynccontextmanager
async def _server(repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    settings = load_settings(
        repo=repo,
        engine={"parallel": 1, "n_threads": 1},
        limits={"template_timeout_s": TIMEOUT_S},
    )
    async with live(create_app(settings)) as port:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            yield client


@pytest.mark.slow
async def test_a_template_bomb_in_a_gguf_is_a_400_and_healthz_stays_fast(tmp_path: Path) -> None:
    repo = _repo_with_template(tmp_path / "repo", FORMAT_BOMB)
    async with _server(repo) as client:
        latencies: list[float] = []

        async def probe() -> None:
            while True:
                start = time.monotonic()
                assert (await client.get("/healthz")).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.02)

        prober = asyncio.create_task(probe())
        body = {"model": "templated", "messages": MESSAGES, "max_tokens": 2}
        start = time.monotonic()
        try:
            for _ in range(3):  # the first starts the render processes
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, r.text
                error = json.loads(r.text)["error"]
                assert error["code"] == "chat_template_limit" and error["param"] == "messages"
        finally:
            prober.cancel()
        assert len(latencies) >= 3  # probed while the renders ran (~0.16 s: ~7 probes)
        assert max(latencies) < 0.25  # it was 7.6 s, then a 500
        assert time.monotonic() - start < 3 * (TIMEOUT_S + SLACK_S) + 2
        ok = await client.post(
            "/v1/completions", json={"model": "templated", "prompt": "x", "max_tokens": 2}
        )
        assert ok.status_code == 200

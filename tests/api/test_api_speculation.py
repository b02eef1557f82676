"""Speculative decoding through the gateway (``routing.speculation``): the reference's
worker holds the model's cheapest other GGUF branch as its draft, passed as a verified
descriptor; greedy text is the reference's own; the header, ``/metrics``, explain and the
placement say so. Real llama.cpp workers on a GGUF-only copy of the demo model."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qrtest import demo_repo_copy, serving
from quantroute.api import jobs as jobs_module
from quantroute.api.app import create_app
from quantroute.api.gateway import Gateway
from quantroute.api.schemas import ChatCompletionRequest, CompletionRequest
from quantroute.config import load_settings
from quantroute.engines.llamacpp.engine import LlamaCppEngine
from quantroute.errors import ConfigError
from quantroute.observability import Tracing

PROMPTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n")


@pytest.mark.parametrize(
    "routing",
    [{"speculation": "sometimes"}, {"speculation_k_max": 0}, {"speculation_k_max": 65}],
)
def test_a_bad_speculation_setting_is_refused(routing: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"routing\.speculation"):
        load_settings(routing=routing)


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("extra", "drafted"),
    [
        ({}, True),
        ({"temperature": 0, "seed": 7}, True),  # greedy: the seed draws nothing
        ({"temperature": 0.7}, True),
        ({"temperature": 0.7, "seed": 7}, False),  # a seed repeats for one schedule only
        ({"logprobs": True}, False),
        ({"response_format": {"type": "json_object"}}, False),
        ({"response_format": _SCHEMA}, False),
        ({"presence_penalty": 0.5}, False),
        ({"repetition_penalty": 1.1}, False),
    ],
)
def test_routing_credits_drafting_only_to_requests_that_are_drafted(
    extra: dict[str, Any], drafted: bool
) -> None:
    """A reference's speed-up is a promise only for what its worker drafts: a grammar,
    logprobs, penalties and a seeded sample decode plainly, so the deadline filter must
    not count on drafting for them (``RequestShape.drafted``)."""
    chat = ChatCompletionRequest.model_validate(_CHAT | extra)
    assert jobs_module.drafted(chat) is drafted
    # a completion's logprobs is a count: 0 still asks for the sampled token's
    completion = {"model": "m", "prompt": "x"} | {
        k: (0 if k == "logprobs" else v) for k, v in extra.items()
    }
    assert jobs_module.drafted(CompletionRequest.model_validate(completion)) is drafted


def test_speculation_is_on_by_default() -> None:
    r = load_settings().routing
    assert (r.speculation, r.speculation_k_max) == ("auto", 8)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_repo_copy(tmp_path_factory.mktemp("spec"), engine="llamacpp")


@contextlib.asynccontextmanager
async def _serve(
    repo: Path, speculation: str, exporter: InMemorySpanExporter
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    settings = load_settings(
        repo=repo,
        engine={"parallel": 2, "n_threads": 1},
        routing={"speculation": speculation},
    )
    app = create_app(settings)
    app.state.gateway.observer.tracing = Tracing(exporter, batch=False)
    async with serving(app) as served:
        yield served


async def _complete(client: httpx.AsyncClient, model: str, prompt: str, **extra: Any) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def _counter(metrics: str, name: str) -> float:
    """The ``tiny-llama`` f16 → q4_k_m series of ``name`` (0 when absent)."""
    labels = r'\{draft="q4_k_m",model="tiny-llama",reference="f16"\}'
    found = re.search(rf"^{name}_total{labels} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _cmdline(pid: int | None) -> list[str]:
    """What the worker ``pid`` was started with."""
    assert pid is not None
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


async def _serve_all(repo: Path, speculation: str) -> dict[str, Any]:
    """What one server with ``speculation`` answers: the f16's greedy texts and headers,
    the counters, explain, the f16's engine and placement."""
    exporter = InMemorySpanExporter()
    async with _serve(repo, speculation, exporter) as (client, gateway):
        before = (await client.get("/metrics")).text
        texts, drafts = [], []
        for prompt in PROMPTS:
            r = await _complete(client, "tiny-llama:f16", prompt)
            texts.append(r.json()["choices"][0]["text"])
            drafts.append(r.headers.get("x-quantroute-draft"))
        logprobs = await _complete(client, "tiny-llama:f16", PROMPTS[1], logprobs=2)
        q4 = await _complete(client, "tiny-llama:q4_k_m", PROMPTS[0])
        middle = (await client.get("/metrics")).text
        seeded = await _complete(client, "tiny-llama:f16", PROMPTS[0], temperature=0.8, seed=7)
        after = (await client.get("/metrics")).text
        explain = await client.post(
            "/v1/route/explain", json={"model": "tiny-llama", "prompt": "x", "quality": "exact"}
        )
        pinned = await client.post(
            "/v1/route/explain", json={"model": "tiny-llama:f16", "prompt": "x"}
        )
        f16 = gateway.routes.current.models["tiny-llama"].branch("f16")
        assert f16 is not None and isinstance(f16.engine, LlamaCppEngine)
        placement = gateway.occupancy.get("tiny-llama:f16")
        assert placement is not None
        return {
            "texts": texts,
            "drafts": drafts,
            "q4_draft": q4.headers.get("x-quantroute-draft"),
            "logprobs_draft": logprobs.headers.get("x-quantroute-draft"),
            "seeded_draft": seeded.headers.get("x-quantroute-draft"),
            "counts": [
                (
                    _counter(m, "quantroute_speculative_drafted_tokens"),
                    _counter(m, "quantroute_speculative_accepted_tokens"),
                )
                for m in (before, middle, after)
            ],
            "explain": explain.json(),
            "pinned": pinned.json(),
            "engine": f16.engine,
            "argv": _cmdline(f16.engine.pid),
            "estimated": placement.footprint.estimated_bytes,
            "decodes": [
                dict(span.attributes or {})
                for span in exporter.get_finished_spans()
                if span.name == "quantroute.decode"
            ],
        }


@pytest.mark.slow
async def test_speculation_serves_the_references_greedy_text_and_says_so(repo: Path) -> None:
    on = await _serve_all(repo, "always")
    off = await _serve_all(repo, "off")

    # the same greedy text, token for token, drafted or not
    assert on["texts"] == off["texts"]
    assert all(len(t) > 10 for t in on["texts"])

    # the header names the draft on the reference's drafted answers only
    assert on["drafts"] == ["tiny-llama:q4_k_m"] * len(PROMPTS)
    assert off["drafts"] == [None] * len(PROMPTS)
    assert on["q4_draft"] is None and off["q4_draft"] is None
    assert on["seeded_draft"] is None  # a seeded sampled request decodes plainly
    assert on["logprobs_draft"] is None  # so does one asking for logprobs: the worker said

    # the counters: drafted tokens, of which some kept, and none for the seeded request
    (d0, a0), (d1, a1), (d2, a2) = on["counts"]  # the logprobs request drafted nothing
    assert d1 - d0 > 0 and 0 < a1 - a0 <= d1 - d0
    assert (d2, a2) == (d1, a1)
    assert off["counts"] == [(0.0, 0.0)] * 3

    # the worker got the draft as a verified descriptor, never the manifest's path
    argv = on["argv"]
    assert argv[argv.index("--spec-mode") + 1] == "always"
    assert re.fullmatch(r"/proc/self/fd/\d+", argv[argv.index("--draft") + 1])
    assert "--draft" not in off["argv"]
    assert on["engine"].draft.branch_id == "tiny-llama:q4_k_m"
    assert on["engine"].info.draft == "tiny-llama:q4_k_m"
    assert off["engine"].draft is None and off["engine"].info.draft is None

    # explain shows it: the route's mode and draft, and the reference's row drafted
    spec = on["explain"]["speculation"]
    measured = spec.pop("measured")
    assert spec == {
        "mode": "always",
        "k_max": 8,
        "draft": "tiny-llama:q4_k_m",
        "drafted": ["tiny-llama:f16"],
        "problems": {},
    }
    # and what drafting gave so far: the drafted requests, all their tokens, recent rates
    f16 = measured["tiny-llama:f16"]
    assert f16["requests"] == len(PROMPTS)
    assert (f16["drafted_tokens"], f16["accepted_tokens"]) == (d1 - d0, a1 - a0)
    assert 0 < f16["acceptance_rate"] <= 1 and 1 <= f16["mean_k"] <= 8
    # "always" never decodes plainly, so measures no speed-up: routing credits none
    assert f16["speedup"] is None and f16["routed_speedup"] == 1.0
    rows = {row["branch"]: row["draft"] for row in on["explain"]["branches"]}
    assert rows["tiny-llama:f16"] == "tiny-llama:q4_k_m" and rows["tiny-llama:q4_k_m"] is None
    assert on["pinned"]["speculation"]["drafted"] == ["tiny-llama:f16"]
    assert off["explain"]["speculation"]["draft"] is None
    assert off["explain"]["speculation"]["mode"] == "off"
    assert off["explain"]["speculation"]["measured"] == {}

    # the decode spans: the drafted ones carry the draft and its acceptance
    drafted = [a for a in on["decodes"] if "quantroute.speculative.draft" in a]
    assert len(drafted) == len(PROMPTS) and len(on["decodes"]) == len(PROMPTS) + 3
    for a in drafted:
        assert a["quantroute.speculative.draft"] == "tiny-llama:q4_k_m"
        assert 0 < a["quantroute.speculative.accepted"] <= a["quantroute.speculative.drafted"]
        rate = a["quantroute.speculative.accepted"] / a["quantroute.speculative.drafted"]
        assert a["quantroute.speculative.acceptance_rate"] == pytest.approx(rate)
        assert 1 <= a["quantroute.speculative.k"] <= 8
    assert not any("quantroute.speculative.draft" in a for a in off["decodes"])

    # the reference's placement counts its draft's weights and cells too
    assert on["estimated"] > off["estimated"]


def test_a_reference_placed_without_room_for_its_draft_starts_without_it(tmp_path: Path) -> None:
    """Placement's verdict reaches the engine (``Offload.draft_dropped``): its worker's argv has
    no draft, it claims none, and says why; room again (a later placement) restores it."""
    from quantroute.engines.llamacpp.draft import Draft
    from quantroute.engines.llamacpp.engine import WorkerOptions
    from quantroute.engines.supervisor import RestartPolicy
    from quantroute.types import Offload

    model, q4 = tmp_path / "f16.gguf", tmp_path / "q4_k_m.gguf"
    engine = LlamaCppEngine("m:f16", model, WorkerOptions(), RestartPolicy())
    engine.speculate(Draft("m:q4_k_m", q4, None))
    assert engine.draft is not None and "--draft" in engine._supervisor.argv
    why = "its draft q4_k_m.gguf does not fit beside it on sim:0"
    engine.offload(Offload(draft_dropped=why))
    assert engine.draft is None and "--draft" not in engine._supervisor.argv
    assert engine.draft_problem == why
    engine.offload(Offload())
    assert engine.draft is not None and engine.draft_problem is None
    assert engine._supervisor.argv[engine._supervisor.argv.index("--draft") + 1] == str(q4)


@pytest.mark.slow
async def test_auto_measures_the_speedup_routing_credits_the_reference_with(repo: Path) -> None:
    """``auto``: the worker measures plain decoding beside each ``k`` and reports the
    best's rate over plain's; the engine folds it in, and routing reads it in steps."""
    from quantroute.engines.llamacpp.draft import routed_speedup

    async with _serve(repo, "auto", InMemorySpanExporter()) as (client, gateway):
        for prompt in PROMPTS:
            await _complete(client, "tiny-llama:f16", prompt, max_tokens=64)
        explain = await client.post(
            "/v1/route/explain", json={"model": "tiny-llama:f16", "prompt": "x"}
        )
        f16 = gateway.routes.current.models["tiny-llama"].branch("f16")
        assert f16 is not None and isinstance(f16.engine, LlamaCppEngine)
        stats, info = f16.engine.speculation, f16.engine.info
    assert stats.requests == len(PROMPTS) and stats.speedup > 0  # measured against plain
    assert info is not None and info.speedup == routed_speedup(stats.speedup)
    measured = explain.json()["speculation"]["measured"]["tiny-llama:f16"]
    assert measured["speedup"] == round(stats.speedup, 3)
    assert measured["routed_speedup"] == info.speedup

"""A remote branch's fidelity, measured from its server's top-k log-probabilities.

The client against stand-ins of vLLM's echo answers and of llama-server's withheld
log-probabilities (``httpx.MockTransport``: neither quirk can be provoked at will in a
real server), then ``quantroute profile`` against real llama-server processes (the one
``scripts/llama_server_build.sh`` builds) serving the demo model's files, and the
profile's life in ``profile.json`` and the manifest (measured, declared).

``quantroute.quality.remote`` is imported inside the tests: importing it at collection
would make it an attribute of ``quantroute.quality`` before ``test_quality_exports``
runs.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import yaml

from llama_servers import LlamaServer, llama_servers
from qrtest import demo_model_dir, demo_repo_copy
from quantroute.divergence import kl_divergence, kl_divergence_topk, log_softmax, top_k
from quantroute.errors import ConfigError
from quantroute.quality.profile import (
    PROFILE_NAME,
    Measure,
    load_profiles,
    profile_key,
    read_profile,
    remote_key,
)
from quantroute.registry.manifest import MANIFEST_NAME, check_artifacts, load_manifest

VOCAB = 40
K = 5
F64 = npt.NDArray[np.float64]


def bigram(seed: int = 0) -> F64:
    """A stand-in model: the next token's log-probabilities given the last, ``[V, V]``."""
    return log_softmax(np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)) * 2.5)


def expected_rows(table: F64, tokens: list[int], start: int, k: int) -> tuple[F64, Any]:
    rows = table[np.asarray(tokens[start:-1])]  # [S, V]: row p predicts tokens[p + 1]
    return rows, top_k(rows, k, also=np.asarray(tokens[start + 1 :]))


def vllm_echo(table: F64, seen: list[dict[str, Any]]) -> Callable[[httpx.Request], httpx.Response]:
    """vLLM's legacy completion with ``echo`` and ``return_tokens_as_token_ids``: the
    prompt's own log-probabilities and top-k (its own token added), first ``None``."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        assert request.url.path == "/v1/completions" and body["model"] == "m"
        assert body["echo"] and body["return_tokens_as_token_ids"] and body["max_tokens"] == 1
        ids, k = body["prompt"], body["logprobs"]
        generated = int(np.argmax(table[ids[-1]]))
        tokens = [*ids, generated]
        tops: list[dict[str, float] | None] = [None]
        own: list[float | None] = [None]
        for i in range(1, len(tokens)):
            dist = table[tokens[i - 1]]
            top = {f"token_id:{t}": float(dist[t]) for t in np.argsort(-dist)[:k]}
            top[f"token_id:{tokens[i]}"] = float(dist[tokens[i]])
            tops.append(top)
            own.append(float(dist[tokens[i]]))
        logprobs = {
            "tokens": [f"token_id:{t}" for t in tokens],
            "token_logprobs": own,
            "top_logprobs": tops,
            "text_offset": list(range(len(tokens))),
        }
        return httpx.Response(200, json={"choices": [{"text": "x", "logprobs": logprobs}]})

    return handle


def llama_server_like(
    table: F64, partial: set[int], seen: list[dict[str, Any]]
) -> Callable[[httpx.Request], httpx.Response]:
    """llama-server's one-token completion: ``logprobs.content`` with ids, ``echo``
    ignored, and no log-probabilities at all when the token emitted ends inside a UTF-8
    character (the ``partial`` ids)."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        dist = table[body["prompt"][-1]]
        biased = dist.copy()
        for tok, bias in (body.get("logit_bias") or {}).items():
            biased[int(tok)] += bias
        emitted = int(np.argmax(biased))
        if emitted in partial:
            return httpx.Response(200, json={"choices": [{"text": "", "logprobs": None}]})

        def entry(t: int) -> dict[str, Any]:
            return {"id": t, "logprob": float(dist[t]), "bytes": [0xC3 if t in partial else 65]}

        top = [entry(int(t)) for t in np.argsort(-dist)[: body["logprobs"]]]
        content = [{**entry(emitted), "top_logprobs": top}]
        return httpx.Response(
            200, json={"choices": [{"text": "A", "logprobs": {"content": content}}]}
        )

    return handle


def score(handler: Callable[[httpx.Request], httpx.Response], tokens: list[int], **kw: Any) -> Any:
    from quantroute.quality.remote import Endpoint, TopkClient

    async def run() -> Any:
        transport = httpx.MockTransport(handler)
        async with TopkClient(Endpoint("http://gpu:8000/v1", "m"), transport=transport, **kw) as c:
            return await c.score(tokens, 3), c

    return asyncio.run(run())


TOKENS = [1, 7, 3, 9, 12, 30, 2, 2, 17, 39, 0, 5]


def test_echo_reads_a_chunk_in_one_request() -> None:
    from quantroute.quality.remote import Dialect

    table, seen = bigram(), []
    rows, client = score(vllm_echo(table, seen), TOKENS, k=K)
    full, want = expected_rows(table, TOKENS, 3, K)
    assert client.dialect is Dialect.ECHO and len(seen) == 1
    assert rows.ids.tolist() == want.ids.tolist()
    assert np.allclose(rows.logprobs, want.logprobs)
    assert kl_divergence_topk(full, rows) == pytest.approx(np.zeros(len(TOKENS) - 4), abs=1e-12)


def test_forced_reads_each_position_and_the_next_tokens_own_logprob() -> None:
    from quantroute.quality.remote import FORCE_BIAS, Dialect

    table, seen = bigram(1), []
    rows, client = score(llama_server_like(table, set(), seen), TOKENS, k=K)
    _, want = expected_rows(table, TOKENS, 3, K)
    assert client.dialect is Dialect.FORCED and client.unforced == 0
    assert seen[0]["echo"] and len(seen) == 1 + len(TOKENS) - 4  # the echo probe, then each
    for p, body in enumerate(seen[1:], start=3):
        assert body["prompt"] == TOKENS[: p + 1]
        assert body["logit_bias"] == {str(TOKENS[p + 1]): FORCE_BIAS}
    assert rows.ids.tolist() == want.ids.tolist()
    assert np.allclose(rows.logprobs, want.logprobs)


def test_a_token_the_server_withholds_is_replaced_and_its_logprob_bounded() -> None:
    table, seen = bigram(2), []
    partial = {TOKENS[9]}  # token 39, once in TOKENS: position 8 predicts it
    rows, client = score(llama_server_like(table, partial, seen), TOKENS, k=K)
    assert client.unforced == 1
    retry = [b for b in seen if b["prompt"] == TOKENS[:9]]
    assert retry[0]["logit_bias"] == {str(TOKENS[9]): 100.0}
    assert retry[1]["logit_bias"] != retry[0]["logit_bias"]  # a whole-character token instead
    row = rows.ids[8 - 3]
    listed_top = np.argsort(-table[TOKENS[8]])[:K]
    assert set(row[row >= 0].tolist()) == set(listed_top.tolist())


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"content": [{"token": "a", "logprob": -1.0, "top_logprobs": []}]}, "text, not ids"),
        ({"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}]}, "text"),
        (None, "no log-probabilities"),
    ],
)
def test_a_server_without_token_ids_cannot_be_measured(answer: Any, why: str) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"text": "a", "logprobs": answer}]})

    with pytest.raises(ConfigError, match=why) as info:
        score(handle, TOKENS)
    assert info.value.error_code == "remote_no_logprobs"


def test_a_server_that_refuses_twenty_logprobs_cannot_be_measured() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "logprobs must be at most 5"}})

    with pytest.raises(ConfigError, match="refuses logprobs") as info:
        score(handle, TOKENS)
    assert info.value.error_code == "remote_no_logprobs"


def test_the_model_name_comes_from_models_when_unnamed() -> None:
    from quantroute.quality.remote import Endpoint, TopkClient

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer sk-1"
        return httpx.Response(200, json={"data": [{"id": "served", "meta": {"n_vocab": 354}}]})

    async def run() -> tuple[str, int | None]:
        endpoint = Endpoint("http://gpu:8000/v1", None, "sk-1")
        async with TopkClient(endpoint, transport=httpx.MockTransport(handle)) as client:
            return await client.model(), await client.n_vocab()

    assert asyncio.run(run()) == ("served", 354)


# ---- profile.json and the manifest ------------------------------------------------------------


def model_with_remotes(root: Path, remotes: dict[str, dict[str, Any]]) -> Path:
    """A copy of the demo model's GGUF branches (the local side these remotes are
    compared with) under ``root``, its manifest adding ``remotes`` (url branches)."""
    model_dir = demo_repo_copy(root, engine="llamacpp") / "tiny-llama"
    (model_dir / PROFILE_NAME).unlink()  # the packaged one: these tests start unprofiled
    manifest = yaml.safe_load((model_dir / MANIFEST_NAME).read_text())
    manifest["branches"].update(remotes)
    (model_dir / MANIFEST_NAME).write_text(yaml.safe_dump(manifest))
    return model_dir


def test_a_declared_profile_is_shown_as_declared_never_as_measured(tmp_path: Path) -> None:
    declared = {"mean_kld": 0.002, "top1": 0.97, "decode_tps": 40.0}
    spec = {"url": "http://gpu:8000/v1", "engine": "openai", "precision": "fp8"}
    model_dir = model_with_remotes(tmp_path / "m", {"fp8": {**spec, "profile": declared}})
    artifacts = check_artifacts(model_dir, load_manifest(model_dir))
    profiles, warnings = load_profiles(model_dir, artifacts)
    fp8 = profiles["fp8"]
    assert fp8 is not None and not fp8.measured
    assert fp8.fidelity.measure is Measure.DECLARED
    assert (fp8.mean_kld, fp8.top1, fp8.decode_tps) == (0.002, 0.97, 40.0)
    assert fp8.quality.n_tokens == 0 and math.isnan(fp8.kld_p99)  # unknown, not invented
    assert not any("fp8" in w for w in warnings)  # declared is not "not profiled yet"
    assert profiles["q8_0"] is None  # the copy has no profile.json


def test_remote_keys_follow_the_endpoint(tmp_path: Path) -> None:
    spec = {"url": "http://gpu:8000/v1", "engine": "openai", "precision": "fp8"}
    model_dir = model_with_remotes(
        tmp_path / "m", {"a": spec, "b": {**spec, "remote_model": "llama-fp8"}}
    )
    arts = {a.name: a for a in check_artifacts(model_dir, load_manifest(model_dir))}
    assert profile_key(arts["a"]) == remote_key("http://gpu:8000/v1", "a")  # the branch's name
    assert profile_key(arts["b"]) == remote_key("http://gpu:8000/v1", "llama-fp8")
    assert profile_key(arts["q8_0"]) == arts["q8_0"].sha256


# ---- against real llama-server processes (slow) ------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """llama-server for the demo model's f16 (the reference) and q8_0 files."""
    logs = tmp_path_factory.mktemp("llama-server")
    flags = ("-t", "1", "-tb", "1", "--parallel", "1", "-c", "256")
    each = {n: LlamaServer(demo_model_dir() / f"{n}.gguf", logs / f"{n}.log", flags)
            for n in ("f16", "q8_0")}  # fmt: skip
    with llama_servers(each):
        yield {n: server.url for n, server in each.items()}


def local_rows(gguf: Path, n_ctx: int, first: int) -> tuple[list[int], F64]:
    """The demo text's first chunk (BOS first) and llama.cpp's log-probabilities of its
    rows ``first .. n_ctx - 2``, evaluated a token at a time, as llama-server does."""
    from quantroute.quality.profiler import _LlamaRunner, default_calibration_text

    with _LlamaRunner(gguf, n_ctx=n_ctx, n_threads=1) as llm:
        tokens = llm.tokenize(default_calibration_text())[:n_ctx].copy()
        tokens[0] = llm.bos
        llm.decode(tokens[:first].tolist(), pos0=0, rows=(first - 1, first))
        rows = [
            llm.decode([int(tokens[i])], pos0=i, rows=(0, 1))[0] for i in range(first, n_ctx - 1)
        ]
    return tokens.tolist(), log_softmax(np.array(rows))


@pytest.mark.slow
@pytest.mark.parametrize("k", [20, 354])
def test_llama_server_gives_the_rows_llama_cpp_computes(servers: dict[str, str], k: int) -> None:
    """Sent as ids, forced a position at a time, llama-server's listed log-probabilities
    are the file's own: every listed token the local top-k, within float32 rounding. At
    k = 354 (the demo's whole vocabulary) the estimate is the full KLD: zero."""
    from quantroute.quality.remote import Dialect, Endpoint, TopkClient

    tokens, want = local_rows(demo_model_dir() / "f16.gguf", 128, 64)

    async def run() -> Any:
        async with TopkClient(Endpoint(servers["f16"], "f16"), k=k) as client:
            return await client.score(tokens, 64), client

    rows, client = asyncio.run(run())
    assert client.dialect is Dialect.FORCED and client.unforced == 0
    assert rows.n_rows == 63
    listed = rows.ids >= 0
    got = np.take_along_axis(want, np.maximum(rows.ids, 0), axis=1)
    assert np.abs(np.where(listed, rows.logprobs - got, 0.0)).max() < 1e-3
    assert kl_divergence_topk(want, rows).max() < 1e-5
    if k == 354:
        assert listed.all() or (listed.sum(axis=1) == 354).all()
        assert kl_divergence_topk(want, rows) == pytest.approx(kl_divergence(want, want), abs=1e-5)


@pytest.mark.slow
def test_profile_measures_remote_branches_through_their_servers(
    servers: dict[str, str], tmp_path: Path
) -> None:
    from quantroute.quality import format_table, profile_model

    remotes = {
        "remote_f16": {"url": servers["f16"], "engine": "openai", "precision": "f16"},
        "remote_q8": {"url": servers["q8_0"], "engine": "openai", "precision": "q8_0"},
        "mute": {
            "url": servers["q8_0"],
            "engine": "openai",
            "precision": "q8_0",
            "remote": {"logprobs": False},
            "profile": {"mean_kld": 0.001, "top1": 0.98},
        },
    }
    model_dir = model_with_remotes(tmp_path, remotes)
    result = profile_model(
        model_dir, n_ctx=128, max_chunks=3, n_threads=1, decode_tokens=16, progress=False
    )
    by_name = {p.branch: p for p in result.branches}
    assert set(by_name) == {"f16", "q8_0", "q4_k_m", "remote_f16", "remote_q8"}  # mute: declared
    for name in ("remote_f16", "remote_q8"):
        fid = by_name[name].fidelity
        assert (fid.measure, fid.top_k, fid.dialect) == (Measure.TOPK, 20, "forced")
        assert 0 < fid.tail_mass < 0.1
        assert by_name[name].quality.n_tokens == 3 * 63
    # the reference served remotely: only llama.cpp's one-token path differs from its batch
    assert by_name["remote_f16"].mean_kld < 1e-5 and by_name["remote_f16"].top1 > 0.99
    local, remote = by_name["q8_0"], by_name["remote_q8"]
    assert 0.5 * local.mean_kld < remote.mean_kld < 1.5 * local.mean_kld
    assert abs(remote.top1 - local.top1) <= 0.03
    assert remote.quality.ppl_q == pytest.approx(local.quality.ppl_q, rel=0.02)  # exact q(next)

    doc = read_profile(model_dir)
    assert doc.branches[remote_key(servers["q8_0"], "remote_q8")].fidelity is not None
    assert doc.branches[local.sha256].fidelity is None  # local files: measured in full
    artifacts = check_artifacts(model_dir, load_manifest(model_dir))
    loaded, warnings = load_profiles(model_dir, artifacts)
    assert loaded["remote_q8"] is not None and loaded["remote_q8"].fidelity == remote.fidelity
    assert loaded["mute"] is not None and loaded["mute"].fidelity.measure is Measure.DECLARED
    assert not warnings
    table = format_table(result)
    assert "remote_q8: from its server's top-20 log-probabilities (forced)" in table
    assert (model_dir / PROFILE_NAME).is_file()

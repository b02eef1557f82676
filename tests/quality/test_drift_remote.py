"""The drift monitor on remote branches (``engine: openai``).

A remote's answer comes as text: the reference's worker tokenizes it while writing its
logits and says which ids it took; the remote's server is asked for its top-20 along
those ids and the comparison is the top-k estimate, a lower bound of the full KLD.

Against real ``llama-server`` processes serving the demo's q8_0 and a damaged f16 (its
weights perturbed): the estimate is at most the full KLD that the same file scores
locally and not far below it, top-1 agreement is the local one, a damaged remote is
flagged degraded and a healthy one is not, and no logits file is left behind. Without
servers: what the monitor hands each side, and that a model whose reference is remote
has no replay.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from llama_servers import LlamaServer, llama_servers
from qrtest import demo_model_dir
from quantroute.config import DriftSettings
from quantroute.demo.gguf_export import perturb_gguf_weights
from quantroute.engines.base import (
    EngineInfo,
    GenerationRequest,
    ReferenceLogits,
    SamplingParams,
    TokenEvent,
    TokenScores,
)
from quantroute.engines.llamacpp.engine import LlamaCppEngine, WorkerOptions
from quantroute.engines.openai.engine import OpenAIEngine, RemoteConfig
from quantroute.engines.openai.topk import Endpoint, TopkClient
from quantroute.engines.supervisor import RestartPolicy
from quantroute.errors import EngineError
from quantroute.quality.drift import Baseline, DriftMonitor, LogitsFiles, Replay
from quantroute.quality.profile import load_profiles
from quantroute.registry.manifest import load_manifest, verify_artifacts

log = logging.getLogger(__name__)

PROMPTS = ["def ", "class Parser:\n", "import os\n"]
INFO = EngineInfo(512, 512, 354, 4, None, "<s>", "</s>", 0)


# ---- what the monitor hands each side (no servers) -------------------------------------------


@dataclass
class Recorder:
    """A scorer that records its calls: a reference that tokenizes text into 3 ids after
    a 2-token prompt, or a branch that scores everything 0."""

    calls: list[tuple[str, dict[str, object]]] = field(default_factory=list)
    ready: bool = True
    can_score: bool = True
    in_flight: int = 0
    info: EngineInfo | None = field(default_factory=lambda: INFO)

    async def write_logits(
        self,
        prompt: str,
        tokens: list[int],
        path: Path,
        *,
        parse_special: bool = False,
        text: str | None = None,
        limit: int = 0,
    ) -> ReferenceLogits:
        self.calls.append(("write", {"tokens": tokens, "text": text, "limit": limit}))
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # the file a worker makes
        scored = tokens or [7, 8, 9][:limit]
        return ReferenceLogits(path, len(scored), 354, ids=(1, 5, *scored))

    async def score(
        self,
        prompt: str,
        tokens: list[int],
        reference: ReferenceLogits,
        *,
        parse_special: bool = False,
    ) -> TokenScores:
        self.calls.append(("score", {"tokens": tokens, "ids": reference.ids}))
        return TokenScores(np.zeros(len(tokens)), np.ones(len(tokens), dtype=np.bool_))


def _monitor(ref: Recorder, branch: Recorder, tmp_path: Path, **kw: object) -> DriftMonitor:
    settings = DriftSettings(fraction=1.0, window_tokens=8, **kw)  # type: ignore[arg-type]
    return DriftMonitor(
        settings,
        reference={"m:remote": "m:ref"},
        scorers={"m:ref": ref, "m:remote": branch},
        baselines={},
        files=LogitsFiles([tmp_path]),
    )


async def test_a_replay_without_ids_goes_as_text_and_is_scored_on_the_references_ids(
    tmp_path: Path,
) -> None:
    ref, branch = Recorder(), Recorder()
    monitor = _monitor(ref, branch, tmp_path, max_tokens=2)
    text = "x" * 1000
    assert monitor.offer(Replay("m:remote", "p", (-1, -1, -1), False, text))
    replay = monitor._queue.get_nowait()
    assert replay.tokens == (-1, -1) and len(replay.text) == 2 * 32  # bounded: 32 chars a token
    await monitor.replay(replay)
    (what, wrote), (_, scored) = ref.calls[0], branch.calls[0]
    assert what == "write" and wrote == {"tokens": [], "text": "x" * 64, "limit": 2}
    assert scored == {"tokens": [7, 8], "ids": (1, 5, 7, 8)}
    assert monitor.state("m:remote").replays == 1
    assert not os.listdir(tmp_path)  # the file went


async def test_a_replay_with_ids_goes_as_ids_and_one_without_text_is_not_taken(
    tmp_path: Path,
) -> None:
    ref, branch = Recorder(), Recorder()
    monitor = _monitor(ref, branch, tmp_path)
    assert not monitor.offer(Replay("m:remote", "p", (-1, -1), False, ""))
    assert monitor.offer(Replay("m:remote", "p", (3, 4), False, "ignored"))
    await monitor.replay(monitor._queue.get_nowait())
    assert ref.calls[0] == ("write", {"tokens": [3, 4], "text": None, "limit": 0})
    assert branch.calls[0][1]["tokens"] == [3, 4]


def test_a_remote_engine_scores_but_is_never_a_reference() -> None:
    engine = OpenAIEngine("m:r", RemoteConfig("http://127.0.0.1:9/v1", "m"))
    assert engine.can_score and not engine.writes_logits
    mute = OpenAIEngine("m:r", RemoteConfig("http://127.0.0.1:9/v1", "m", logprobs=False))
    assert not mute.can_score
    for server in ("sglang", "quantroute"):  # their OpenAI APIs list no ids
        assert not OpenAIEngine("m:r", RemoteConfig("http://127.0.0.1:9/v1", "m", server)).can_score


async def test_a_branch_that_cannot_be_compared_is_not_offered(tmp_path: Path) -> None:
    ref, branch = Recorder(), Recorder(can_score=False)
    monitor = _monitor(ref, branch, tmp_path)
    assert not monitor.offer(Replay("m:remote", "p", (-1,), False, "text"))
    assert monitor.state("m:remote").dropped == 0  # not a drop: nothing it could replay


async def test_a_remote_that_answers_without_ids_stops_being_replayed() -> None:
    """A server that lists tokens as text (quantroute's, SGLang's) is found out on the
    first replay: that one fails, and the branch is not offered again."""
    import httpx

    def handle(request: httpx.Request) -> httpx.Response:
        lp = {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}]}
        return httpx.Response(200, json={"choices": [{"text": "a", "logprobs": lp}]})

    engine = OpenAIEngine("m:r", RemoteConfig("http://remote/v1", "m", "openai"))
    mock = httpx.MockTransport(handle)
    engine._topk = TopkClient(Endpoint("http://remote/v1", "m"), transport=mock)
    reference = ReferenceLogits(Path("/nonexistent"), 1, 354, ids=(1, 5, 7))
    with pytest.raises(EngineError, match="not"):
        await engine.score("p", [7], reference)
    assert not engine.can_score
    await engine.stop()


# ---- against real llama-server processes (slow) ------------------------------------------------


@pytest.fixture(scope="module")
def remotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """llama-server for the demo's q8_0 and for a damaged f16: their base URLs."""
    root = tmp_path_factory.mktemp("remote-drift")
    damaged = root / "f16-noisy.gguf"
    perturb_gguf_weights(demo_model_dir() / "f16.gguf", damaged, scale=0.3, seed=7)
    each = {
        "q8_0": LlamaServer(demo_model_dir() / "q8_0.gguf", root / "q8_0.log"),
        "damaged": LlamaServer(damaged, root / "damaged.log"),
    }
    with llama_servers(each):
        yield {name: server.url for name, server in each.items()}


@pytest.fixture
async def engines(remotes: dict[str, str]) -> AsyncIterator[dict[str, object]]:
    """The local f16 reference and q8_0, and the two remote branches."""
    options = WorkerOptions(parallel=2, n_threads=1, n_ctx=512)
    made: dict[str, LlamaCppEngine | OpenAIEngine] = {
        "m:ref": LlamaCppEngine("m:ref", demo_model_dir() / "f16.gguf", options, RestartPolicy()),
        "m:q8": LlamaCppEngine("m:q8", demo_model_dir() / "q8_0.gguf", options, RestartPolicy()),
        "m:rq8": OpenAIEngine("m:rq8", RemoteConfig(remotes["q8_0"], "q8_0", "llama-server")),
        "m:rbad": OpenAIEngine("m:rbad", RemoteConfig(remotes["damaged"], "x", "llama-server")),
    }
    await asyncio.gather(*(e.start() for e in made.values()))
    assert all(e.ready for e in made.values())
    try:
        yield dict(made)
    finally:
        for e in made.values():
            await e.stop()


async def _answer(engine: OpenAIEngine, prompt: str, seed: int) -> tuple[tuple[int, ...], str]:
    """What a client got from a remote branch: ids it does not know, and the text."""
    sampling = SamplingParams(max_tokens=48, temperature=0.7, seed=seed)
    events = [e async for e in engine.generate(GenerationRequest(f"r{seed}", prompt, sampling))]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return tuple(t.token_id for t in tokens), "".join(t.text for t in tokens)


@pytest.mark.slow
async def test_a_remote_is_scored_as_its_local_twin_within_the_top_k_bound(
    engines: dict[str, object], tmp_path: Path
) -> None:
    ref, local, remote = engines["m:ref"], engines["m:q8"], engines["m:rq8"]
    assert isinstance(ref, LlamaCppEngine) and isinstance(local, LlamaCppEngine)
    assert isinstance(remote, OpenAIEngine)
    full, estimate, agree_local, agree_remote = [], [], [], []
    for i, prompt in enumerate(PROMPTS):
        ids, text = await _answer(remote, prompt, i)
        assert ids and all(t < 0 for t in ids) and text  # no ids from a plain stream
        path = tmp_path / f"ref{i}.f32"
        written = await ref.write_logits(prompt, [], path, text=text, limit=256)
        tokens = list(written.ids[len(written.ids) - written.n_tokens :])
        assert 0 < written.n_tokens <= 256
        by_local = await local.score(prompt, tokens, written)
        by_remote = await remote.score(prompt, tokens, written)
        # a lower bound, up to llama-server's one-token decode against the worker's batch
        assert (by_remote.kld <= by_local.kld + 2e-4).all()
        full += by_local.kld.tolist()
        estimate += by_remote.kld.tolist()
        agree_local += by_local.top1.tolist()
        agree_remote += by_remote.top1.tolist()
        path.unlink()
    log.warning(
        "%d tokens: full KLD %.6f, top-20 estimate %.6f; top-1 %.3f local, %.3f remote",
        len(full), np.mean(full), np.mean(estimate), np.mean(agree_local), np.mean(agree_remote),
    )  # fmt: skip
    assert np.mean(full) > 1e-5  # q8_0 is not the reference: there is a divergence to bound
    assert 0.5 * np.mean(full) <= np.mean(estimate) <= np.mean(full) + 1e-5
    assert np.mean(np.array(agree_local) == np.array(agree_remote)) >= 0.97


async def _replayed(monitor: DriftMonitor, n: int) -> None:
    async with asyncio.timeout(120):
        while sum(monitor.state(b).replays for b in ("m:rq8", "m:rbad")) < n:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # (what it waits for has no event)


@pytest.mark.slow
async def test_drift_flags_a_damaged_remote_and_not_a_healthy_one(
    engines: dict[str, object], tmp_path: Path
) -> None:
    artifacts = verify_artifacts(demo_model_dir(), load_manifest(demo_model_dir()))
    profiles, _ = load_profiles(demo_model_dir(), artifacts)
    q8 = profiles["q8_0"]  # both serve as q8_0: one of them has gone bad
    assert q8 is not None
    settings = DriftSettings(fraction=1.0, window_tokens=32, windows_to_flag=2)
    files = LogitsFiles([tmp_path])
    monitor = DriftMonitor(
        settings,
        reference={"m:rq8": "m:ref", "m:rbad": "m:ref"},
        scorers=engines,  # type: ignore[arg-type]
        baselines={
            "m:rq8": Baseline(q8.mean_kld, q8.top1),
            "m:rbad": Baseline(q8.mean_kld, q8.top1),
        },
        files=files,
    )
    replays = []
    for branch in ("m:rq8", "m:rbad"):
        remote = engines[branch]
        assert isinstance(remote, OpenAIEngine)
        for i, prompt in enumerate(PROMPTS * 2):
            ids, text = await _answer(remote, prompt, i)
            replays.append(Replay(branch, prompt, ids, False, text))
    monitor.start()
    try:
        assert all(monitor.offer(replay) for replay in replays[:8])  # the queue holds 8
        await _replayed(monitor, 8)
        assert all(monitor.offer(replay) for replay in replays[8:])
        await _replayed(monitor, len(replays))
    finally:
        await monitor.stop()
    healthy, damaged = monitor.state("m:rq8"), monitor.state("m:rbad")
    log.warning("healthy %s; damaged %s", healthy.last, damaged.last)
    assert healthy.windows >= 2 and damaged.windows >= 2
    assert not healthy.degraded and healthy.last is not None and healthy.last.in_bounds
    assert damaged.degraded and damaged.last is not None
    assert damaged.last.mean_kld > q8.mean_kld + settings.kld_delta
    mine = f"{LogitsFiles.PREFIX}{os.getpid()}."
    assert not [n for n in os.listdir(tmp_path) if n.startswith(mine)]


@pytest.mark.slow
async def test_the_gateway_replays_what_a_remote_branch_served(
    remotes: dict[str, str], tmp_path: Path
) -> None:
    """Served through the gateway, a remote branch's answer (text, no ids) is replayed
    through the local reference and the remote's top logprobs: ``/v1/models`` counts it."""
    import yaml

    from qrtest import demo_repo_copy, serving
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    repo = demo_repo_copy(tmp_path)
    manifest_path = repo / "tiny-llama" / "quantroute.yaml"
    manifest = yaml.safe_load(manifest_path.read_text())
    remote = {"server": "llama-server"}
    manifest["branches"]["rq8"] = {
        "engine": "openai", "url": remotes["q8_0"], "precision": "q8_0", "remote": remote
    }  # fmt: skip
    manifest_path.write_text(yaml.safe_dump(manifest))
    settings = load_settings(
        repo=repo, engine={"parallel": 2, "n_threads": 1}, drift={"fraction": 1.0}
    )
    async with serving(create_app(settings)) as (client, _gateway):
        body = {"model": "tiny-llama:rq8", "max_tokens": 24, "temperature": 0.7, "seed": 1,
                "messages": [{"role": "user", "content": "Write a parser."}]}  # fmt: skip
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:rq8"
        drift: dict[str, object] = {}
        async with asyncio.timeout(60):
            while not drift.get("replays"):
                await asyncio.sleep(0.1)
                models = (await client.get("/v1/models")).json()["data"]
                branches = {b["id"]: b for m in models for b in m.get("branches", ())}
                drift = branches["tiny-llama:rq8"]["drift"] or {}
        assert drift["replays"] == 1 and drift["dropped"] == 0

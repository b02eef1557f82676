"""Remote branches against real servers: two ``llama-server`` processes serve the demo
model's q8_0 and q4_k_m files as the branches ``rq8`` and ``rq4`` of ``tiny-llama``,
beside its local f16 (``quantroute serve``, a real process); and one quantroute is a
remote branch of another.

- routing by tier across them (the remotes' fidelity is declared in the manifest);
- a greedy stream through a remote branch is exactly what llama-server says directly;
- a remote killed mid-run: pinned requests get a clean error, never a hang or a silent
  end; unpinned ones are served by another branch; restarted on its port, it is
  routable again by itself within a few probe intervals;
- quantroute behind quantroute: the inner's text under the outer's names.

The regime thresholds are set so that every device is *tight*: the cheapest branch
that meets a request's bound wins, so each tier has one expected branch.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llama_servers import LlamaServer, llama_servers
from qrtest import demo_model_dir, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROBE_S = 0.5  # the remote branches' remote.probe_interval_s
CHAT: Any = [{"role": "user", "content": "Write a function."}]
PROMPT = "def main():\n"
# the demo's own profile numbers for q8_0 and q4_k_m, declared for the remote branches
DECLARED = {
    "rq8": {"mean_kld": 0.00036, "top1": 0.989},
    "rq4": {"mean_kld": 0.0140, "top1": 0.933},
}
TIGHT = {  # every device tight: the cheapest feasible branch fits best
    "QUANTROUTE_ROUTING__AMPLE_FREE_BYTES": str(1 << 50),
    "QUANTROUTE_ROUTING__TIGHT_FREE_BYTES": str(1 << 50),
}


@contextlib.contextmanager
def _llama_servers(root: Path, *names: str) -> Iterator[dict[str, LlamaServer]]:
    servers = {n: LlamaServer(demo_model_dir() / f"{n}.gguf", root / f"{n}.log") for n in names}
    with llama_servers(servers):
        yield servers


def _remote(url: str, precision: str, remote_model: str, **extra: Any) -> dict[str, Any]:
    remote = {"probe_interval_s": PROBE_S}
    return {"engine": "openai", "url": url, "precision": precision,
            "remote_model": remote_model, "remote": remote, **extra}  # fmt: skip


@dataclass
class Setup:
    base: str  # the gateway's
    servers: dict[str, LlamaServer]  # q8_0, q4_k_m
    declared: bool  # the remotes' declared profiles load (else they are unprofiled)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The llama-servers, and ``quantroute serve`` on a repository whose ``tiny-llama`` has
    the local f16 and the remote ``rq8`` (q8_0) and ``rq4`` (q4_k_m)."""
    root = tmp_path_factory.mktemp("remote-branches")
    with _llama_servers(root, "q8_0", "q4_k_m") as servers:
        model = root / "repo" / "tiny-llama"
        model.mkdir(parents=True)
        shutil.copy(demo_model_dir() / "f16.gguf", model)
        shutil.copy(demo_model_dir() / "profile.json", model)  # the f16's (the reference)
        sha = _f16_sha256()
        branches = {
            "f16": {"file": "f16.gguf", "precision": "f16", "sha256": sha},
            "rq8": _remote(servers["q8_0"].url, "q8_0", "q8", profile=DECLARED["rq8"]),
            "rq4": _remote(servers["q4_k_m"].url, "q4_k_m", "q4", profile=DECLARED["rq4"]),
        }
        manifest = {"model": "tiny-llama", "reference": "f16", "branches": branches}
        (model / "quantroute.yaml").write_text(json.dumps(manifest))
        declared = _declared_profiles_load(model)
        if not declared:  # the server would refuse to start: the remotes go unprofiled
            for name in ("rq8", "rq4"):
                del branches[name]["profile"]
            (model / "quantroute.yaml").write_text(json.dumps(manifest))
        with pytest.MonkeyPatch.context() as env:
            env.setenv("QUANTROUTE_ENGINE__N_THREADS", "1")
            for name, value in TIGHT.items():
                env.setenv(name, value)
            with serve_process(root / "repo", "--engine-parallel", "2", ready_s=120) as base:
                _wait_ready(base, {"tiny-llama:rq8", "tiny-llama:rq4"})
                yield Setup(base, servers, declared)


def _declared_profiles_load(model: Path) -> bool:
    """Whether this checkout's profile loader takes a remote branch's declared
    ``profile:`` (quality/profile.py; while it does not, the server fails to start)."""
    from quantroute.engines.table import ENGINES
    from quantroute.quality.profile import load_profiles
    from quantroute.registry.repository import scan_model

    entry = scan_model(model, isolated=False, engines=ENGINES)
    try:
        profiles, _ = load_profiles(model, entry.versions[0])
    except (AttributeError, TypeError):
        return False
    return profiles["rq8"] is not None


def _f16_sha256() -> str:
    import yaml

    manifest = yaml.safe_load((demo_model_dir() / "quantroute.yaml").read_text())
    return str(manifest["branches"]["f16"]["sha256"])


def _branches(base: str) -> dict[str, dict[str, Any]]:
    models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
    return {b["id"]: b for m in models for b in m.get("branches", ())}


def _wait_ready(base: str, ids: set[str], ready: bool = True, limit_s: float = 30.0) -> float:
    """Seconds until every branch in ``ids`` is ``ready`` (as ``/v1/models`` says)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        branches = _branches(base)
        if all(branches[i]["ready"] is ready for i in ids):
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"{sorted(ids)} not ready={ready} in {limit_s:g} s: {_branches(base)}")


# -- routing by tier ---------------------------------------------------------------------


# tier -> the branch that serves it, with the remotes' declared profiles / without
TIERS: dict[str | None, tuple[str, str]] = {
    "exact": ("f16", "f16"),  # only the reference
    "high": ("rq8", "f16"),
    "balanced": ("rq4", "f16"),  # an unprofiled branch meets no bound
    None: ("rq4", "f16"),  # the default tier: balanced
    "fast": ("rq4", "rq4"),  # no bound: the cheapest
}


@pytest.mark.parametrize("tier", list(TIERS), ids=[str(t) for t in TIERS])
def test_tiers_route_across_local_and_remote_branches(setup: Setup, tier: str | None) -> None:
    """Tight everywhere, the cheapest branch within each tier's bound serves: ``high``
    admits f16 and rq8 (declared KLD 0.00036, top-1 0.989), ``balanced`` (the default)
    also rq4 (0.014, 0.933)."""
    branch = TIERS[tier][0 if setup.declared else 1]
    with setup.client() as c:
        for how in ("body", "header"):
            extra: dict[str, Any] = {}
            if tier and how == "body":
                extra["extra_body"] = {"quality": tier}
            elif tier:
                extra["extra_headers"] = {"x-quantroute-quality": tier}
            raw = c.chat.completions.with_raw_response.create(
                model="tiny-llama", messages=CHAT, max_tokens=4, temperature=0, **extra
            )
            assert raw.headers["x-quantroute-branch"] == f"tiny-llama:{branch}", how
            assert raw.parse().model == f"tiny-llama:{branch}"


def _needs_declared(setup: Setup) -> None:
    if not setup.declared:
        pytest.skip("declared profiles of remote branches do not load yet (quality/profile.py)")


def test_explain_shows_the_declared_bounds(setup: Setup) -> None:
    _needs_declared(setup)
    r = httpx.post(
        f"{setup.base}/v1/route/explain",
        json={"model": "tiny-llama", "prompt": "x", "quality": "high"},
        timeout=10,
    ).json()
    feasible = {b["branch"]: b["feasible"] for b in r["branches"]}
    assert feasible == {"tiny-llama:f16": True, "tiny-llama:rq8": True, "tiny-llama:rq4": False}
    (rq4,) = [b for b in r["branches"] if b["branch"] == "tiny-llama:rq4"]
    quality = {f["name"]: f for f in rq4["filters"]}["quality"]
    assert not quality["passed"] and "0.014" in quality["reason"]
    models = _branches(setup.base)
    assert models["tiny-llama:rq8"]["profile"]["mean_kld"] == DECLARED["rq8"]["mean_kld"]


# -- the same text as llama-server's own -------------------------------------------------


def _collect(stream: Any, chat: bool) -> tuple[str, str | None, Any, list[Any]]:
    """A stream's text, finish reason, usage and chunks."""
    text, finish, usage, chunks = "", None, None, []
    with stream:
        for chunk in stream:
            chunks.append(chunk)
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += (ch.delta.content or "") if chat else ch.text
                finish = ch.finish_reason or finish
    return text, finish, usage, chunks


def _direct(server: LlamaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize(("branch", "remote"), [("rq8", "q8_0"), ("rq4", "q4_k_m")])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_a_greedy_stream_is_llama_server_s_own_text(
    setup: Setup, branch: str, remote: str, chat: bool
) -> None:
    args: dict[str, Any] = {"max_tokens": 24, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    server = setup.servers[remote]
    with setup.client() as gw, _direct(server) as up:
        if chat:
            ours = gw.chat.completions.create(model=f"tiny-llama:{branch}", messages=CHAT, **args)
            theirs = up.chat.completions.create(model=branch, messages=CHAT, **args)
        else:
            ours = gw.completions.create(model=f"tiny-llama:{branch}", prompt=PROMPT, **args)
            theirs = up.completions.create(model=branch, prompt=PROMPT, **args)
        text, finish, usage, chunks = _collect(ours, chat)
        want, want_finish, want_usage, up_chunks = _collect(theirs, chat)
    assert want  # llama-server said something
    assert text == want
    assert finish == want_finish
    assert usage.completion_tokens == want_usage.completion_tokens
    # the names and ids are the gateway's, not the upstream's
    assert {c.model for c in chunks} == {f"tiny-llama:{branch}"}
    assert not {c.id for c in chunks} & {c.id for c in up_chunks}


def test_an_unpinned_greedy_stream_is_the_same_text(setup: Setup) -> None:
    """Routed by tier (``high``: rq8), the text is llama-server's for q8_0."""
    _needs_declared(setup)
    args: dict[str, Any] = {"max_tokens": 24, "temperature": 0}
    with setup.client() as gw, _direct(setup.servers["q8_0"]) as up:
        raw = gw.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=CHAT, extra_body={"quality": "high"}, **args
        )
        want = up.chat.completions.create(model="q8", messages=CHAT, **args)
    assert raw.headers["x-quantroute-branch"] == "tiny-llama:rq8"
    assert raw.parse().choices[0].message.content == want.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_usage_counts_the_remote_s_prompt_tokens(setup: Setup, stream: bool) -> None:
    """A remote's prompt tokens come with its last chunk (the start says 0): usage has them."""
    args: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
    if stream:
        args |= {"stream": True, "stream_options": {"include_usage": True}}
    with setup.client() as gw, _direct(setup.servers["q8_0"]) as up:
        want = up.completions.create(model="q8", prompt=PROMPT, max_tokens=8, temperature=0)
        if stream:
            usage = _collect(
                gw.completions.create(model="tiny-llama:rq8", prompt=PROMPT, **args), False
            )[2]
        else:
            usage = gw.completions.create(model="tiny-llama:rq8", prompt=PROMPT, **args).usage
    assert want.usage is not None and usage is not None
    assert usage.prompt_tokens == want.usage.prompt_tokens > 0


# -- a remote killed mid-run, and back ----------------------------------------------------


@dataclass
class Outcome:
    status: int
    branch: str | None
    tokens: int = 0  # content chunks received
    done: bool = False  # the stream ended with [DONE] after a finish reason
    error: bool = False  # it ended with an error event
    seconds: float = 0.0


def _stream_once(
    base: str,
    body: dict[str, Any],
    after_first: Any = None,
    timeout: float = 20.0,
) -> Outcome:
    """One streamed chat (``after_first()`` is called once its first token came); a hang
    shows as ``httpx.ReadTimeout``, which fails the test."""
    started = time.monotonic()
    with (
        httpx.Client(timeout=timeout) as c,
        c.stream("POST", f"{base}/v1/chat/completions", json=body | {"stream": True}) as r,
    ):
        out = Outcome(r.status_code, r.headers.get("x-quantroute-branch"))
        if r.status_code != 200:
            r.read()
            error = r.json()["error"]
            assert error["message"] and error["type"]  # OpenAI's shape
            assert r.status_code in (502, 503)
        else:
            finished = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = finished
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = True
                    break
                finished = finished or any(ch.get("finish_reason") for ch in event["choices"])
                if any(ch.get("delta", {}).get("content") for ch in event["choices"]):
                    out.tokens += 1
                    if out.tokens == 1 and after_first is not None:
                        after_first()
    out.seconds = time.monotonic() - started
    return out


def test_a_remote_killed_mid_run_and_restarted(setup: Setup) -> None:
    """rq4's llama-server is frozen (SIGSTOP) and killed just after a pinned stream's
    first token: that stream ends with an error event; unpinned requests are served by
    another branch (the first finds the connection refused and falls back); pinned ones
    get a 503 in OpenAI's shape; none hangs. Started again on its port, rq4 is routable
    again by itself within a few probe intervals, and routing uses it."""
    base, rq4 = setup.base, setup.servers["q4_k_m"]
    long = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    fast = long | {"quality": "fast"}  # rq4 first, with or without declared profiles
    assert _stream_once(base, {"model": "tiny-llama:rq4", **long}).done

    def freeze_and_kill() -> None:
        assert rq4.proc is not None
        rq4.proc.send_signal(signal.SIGSTOP)  # no token more from here
        rq4.kill()

    cut = _stream_once(base, {"model": "tiny-llama:rq4", **long}, after_first=freeze_and_kill)
    assert cut.status == 200 and cut.error and not cut.done, cut
    assert 1 <= cut.tokens < 200 and cut.seconds < 10, cut
    # unpinned, right away: served elsewhere
    for _ in range(3):
        o = _stream_once(base, {"model": "tiny-llama", **fast})
        assert o.status == 200 and o.done, o
        assert o.branch in ("tiny-llama:rq8", "tiny-llama:f16"), o
    down_after = _wait_ready(base, {"tiny-llama:rq4"}, ready=False)
    assert down_after < 2 * PROBE_S + 3, "the probe did not see it go"
    for _ in range(3):  # pinned, while it is down: a clean 503
        o = _stream_once(base, {"model": "tiny-llama:rq4", **long})
        assert o.status == 503 and o.seconds < 5, o

    rq4.start()  # on the same port
    back_after = _wait_ready(base, {"tiny-llama:rq4"}, limit_s=10 * PROBE_S + 5)
    assert back_after < 4 * PROBE_S + 2, f"routable again only after {back_after:.1f} s"
    again = _stream_once(base, {"model": "tiny-llama", **fast})
    assert again.status == 200 and again.done and again.branch == "tiny-llama:rq4", again
    assert _stream_once(base, {"model": "tiny-llama:rq4", **long}).done


# -- quantroute behind quantroute --------------------------------------------------------


@pytest.fixture(scope="module")
def stacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """An inner ``quantroute serve`` of the packaged demo, and an outer one whose model
    ``relay`` has the inner's ``tiny-llama:q8_0`` as its one (remote) branch ``q8``."""
    root = tmp_path_factory.mktemp("stacked")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("QUANTROUTE_ENGINE__N_THREADS", "1")
        with serve_process(demo_model_dir().parent, ready_s=120) as inner:
            remote = _remote(f"{inner}/v1", "q8_0", "tiny-llama:q8_0")
            remote["remote"]["server"] = "quantroute"
            manifest = {"model": "relay", "reference": "q8", "branches": {"q8": remote}}
            (root / "repo" / "relay").mkdir(parents=True)
            (root / "repo" / "relay" / "quantroute.yaml").write_text(json.dumps(manifest))
            with serve_process(root / "repo", ready_s=60) as outer:
                yield inner, outer


def _whole_text(response: Any, chat: bool) -> str:
    choice = response.choices[0]
    return str(choice.message.content if chat else choice.text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_quantroute_behind_quantroute(stacked: tuple[str, str], chat: bool, stream: bool) -> None:
    inner, outer = stacked
    args: dict[str, Any] = {"max_tokens": 16, "temperature": 0}
    if stream:
        args |= {"stream": True, "stream_options": {"include_usage": True}}
    with (
        openai.OpenAI(base_url=f"{inner}/v1", api_key="unused", max_retries=0) as ic,
        openai.OpenAI(base_url=f"{outer}/v1", api_key="unused", max_retries=0) as oc,
    ):
        make = ic.chat.completions.create if chat else ic.completions.create
        omake = oc.chat.completions.create if chat else oc.completions.create
        what: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": PROMPT}
        theirs = make(model="tiny-llama:q8_0", **what, **args)
        ours = omake(model="relay", **what, **args)
        if stream:
            want, want_finish, _, inner_chunks = _collect(theirs, chat)
            text, finish, usage, chunks = _collect(ours, chat)
            models = {c.model for c in chunks}
            ids, inner_ids = {c.id for c in chunks}, {c.id for c in inner_chunks}
        else:
            want, want_finish = _whole_text(theirs, chat), theirs.choices[0].finish_reason
            text, finish = _whole_text(ours, chat), ours.choices[0].finish_reason
            usage, models = ours.usage, {ours.model}
            ids, inner_ids = {ours.id}, {theirs.id}
    assert want and text == want and finish == want_finish
    assert models == {"relay:q8"}  # the outer's names
    assert not ids & inner_ids and len(ids) == 1
    assert usage is not None and usage.completion_tokens > 0

"""The gateway's own cost: quantroute and LiteLLM's proxy in front of the same llama-server.

One run starts one llama-server (llama.cpp's own, ``scripts/llama_server_build.sh``; the
tiny-llama demo model's q8_0 file, one thread, ``--parallel`` slots for the most clients, so
nothing queues in it) and reaches it three ways (``--targets``):

* **direct** -- llama-server itself;
* **quantroute** -- ``quantroute serve`` over a temporary repository whose one model has one
  remote branch: ``engine: openai``, ``url`` the llama-server's ``/v1``, ``remote_model``,
  its pool (``remote.max_connections``) twice the most clients (see
  :func:`quantroute_manifest`);
* **litellm** -- LiteLLM's proxy (``litellm[proxy]`` in a venv of its own, ``--litellm``,
  never a dependency of the project): ``model: openai/<name>`` with ``api_base`` the
  llama-server, **one worker** (``--num_workers 1``; quantroute serves from one process too),
  its logging off (``LITELLM_LOG=ERROR``, ``set_verbose: false``), no database.

Per level of concurrent streaming clients (``--levels``: 1, 16, 64) and round (``--rounds``),
the three targets take turns, who goes first rotating by round, so that the machine's drift
falls on all alike. A turn is ``--requests`` requests (at least 4 per client) from that many
closed-loop clients: the same chat prompts in the same order, greedy, ``max_tokens``, end of
sequence banned (every stream has exactly ``max_tokens`` tokens), ``stream: true`` with
``include_usage``. The client records each request's **TTFT** (sent to its first content
chunk) and **end-to-end** time (sent to the stream's end).

Reported per gateway and level: the **added latency**, the gateway's percentile minus the
direct one of the same round (p50 and p99, of TTFT and of end-to-end), the median over the
rounds; and the gateway's **CPU per streamed token** (psutil: the gateway's process and its
children, over every round's turns, by the tokens streamed through it). **Goal** (issue 33
§4): quantroute's added p99 at most a third of LiteLLM's at every level, TTFT and end-to-end.
**The run fails** when a stream errs, has another token count or another text than the direct
one's for the same prompt.

CPUs (``--no-pin`` for none): llama-server on the first core, the gateways and this client on
the second (one gateway streams at a time; the client's cost is the same for every target).

Run::

    .venv/bin/python benchmarks/bench_litellm.py                       # ~16 minutes on 2 cores
    .venv/bin/python benchmarks/bench_litellm.py --rounds 1 --requests 32 --levels 1 16  # smoke
    .venv/bin/python benchmarks/bench_litellm.py --replot benchmarks/results/gateway-cost-....json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lean_http import Connection, ConnectionClosed  # noqa: E402
from servers import Server, free_port, quantroute_command, tree_cpu_s  # noqa: E402
from stats import fmt, median, percentile  # noqa: E402

log = logging.getLogger("bench_gateway")

RESULTS_DIR = ROOT / "benchmarks" / "results"
BUILD_SCRIPT = ROOT / "scripts" / "llama_server_build.sh"
DEMO_REPO = ROOT / "src" / "quantroute" / "demo" / "repo"
DEFAULT_LITELLM = Path.home() / ".cache" / "quantroute" / "litellm-venv"
DIRECT, QUANTROUTE, LITELLM = "direct", "quantroute", "litellm"
TARGETS = (DIRECT, QUANTROUTE, LITELLM)
GATEWAYS = (QUANTROUTE, LITELLM)
LABELS = {DIRECT: "llama-server alone", QUANTROUTE: "quantroute", LITELLM: "LiteLLM proxy"}
GOAL_RATIO = 1 / 3  # quantroute's added p99 / LiteLLM's, at most
BAN = -100.0  # the logit bias that keeps a token from ever being chosen
PROMPTS = (
    "def read_config(path):",
    "import os\nimport sys\n\n\nclass Cache:",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "for line in open(path):",
)


# -- the math (pure) --------------------------------------------------------------------


def added(gateway: Sequence[float], direct: Sequence[float], q: float) -> float | None:
    """What a gateway adds at percentile ``q``: its percentile minus the direct one's (both
    from the same round). Percentiles, not per-request differences: the requests are not
    paired, only their distributions are."""
    g, d = percentile(gateway, q), percentile(direct, q)
    return None if g is None or d is None else g - d


def ratio(quantroute: float | None, litellm: float | None) -> float | None:
    """quantroute's added latency over LiteLLM's; ``None`` where LiteLLM's is not above zero
    (a ratio to nothing says nothing). Negative where quantroute's is below zero (met)."""
    if quantroute is None or litellm is None or litellm <= 0:
        return None
    return quantroute / litellm


def goal_met(value: float | None) -> bool | None:
    return None if value is None else value <= GOAL_RATIO


# -- records ----------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One streamed request as the client saw it (seconds)."""

    prompt: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int | None = None  # the usage's completion_tokens
    text: str | None = None  # kept for one request per prompt and turn: the text check
    error: str | None = None


@dataclass(slots=True)
class Turn:
    """One target at one level in one round."""

    target: str
    clients: int
    index: int
    wall_s: float
    gateway_cpu_s: float | None  # the gateway's process tree; None for direct
    server_cpu_s: float  # llama-server's
    retries: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens or 0 for s in self.samples)

    def values(self, metric: str) -> list[float]:
        got = (getattr(s, metric) for s in self.samples if s.error is None)
        return [v for v in got if v is not None]

    def stats(self) -> dict[str, float | None]:
        """p50 and p99 of TTFT and end-to-end, in ms."""
        out: dict[str, float | None] = {}
        for metric in ("ttft_s", "e2e_s"):
            for q in (50, 99):
                v = percentile(self.values(metric), q)
                out[f"{metric[:-2]}_p{q}_ms"] = None if v is None else v * 1e3
        return out

    def record(self) -> dict[str, Any]:
        return {
            "target": self.target, "clients": self.clients, "round": self.index,
            "wall_s": self.wall_s, "gateway_cpu_s": self.gateway_cpu_s,
            "server_cpu_s": self.server_cpu_s, "retries": self.retries, "tokens": self.tokens,
            "requests": len(self.samples), "errors": sum(s.error is not None for s in self.samples),
            **self.stats(),
        }  # fmt: skip


METRICS = ("ttft", "e2e")
QS = (50, 99)


def added_per_round(turns: Sequence[Turn], gateway: str, clients: int) -> dict[str, list[float]]:
    """Per round: the gateway's added latency (ms) for each of ttft/e2e at p50/p99."""
    out: dict[str, list[float]] = {f"{m}_p{q}": [] for m in METRICS for q in QS}
    rounds = sorted({t.index for t in turns if t.clients == clients})
    for index in rounds:
        pick = {t.target: t for t in turns if t.clients == clients and t.index == index}
        if gateway not in pick or DIRECT not in pick:
            continue
        for m in METRICS:
            for q in QS:
                got = added(pick[gateway].values(f"{m}_s"), pick[DIRECT].values(f"{m}_s"), q)
                if got is not None:
                    out[f"{m}_p{q}"].append(got * 1e3)
    return out


def cpu_us_per_token(turns: Sequence[Turn], target: str, clients: int) -> float | None:
    """The target's CPU over all its turns at this level, per streamed token (µs)."""
    mine = [t for t in turns if t.target == target and t.clients == clients]
    tokens = sum(t.tokens for t in mine)
    if not mine or not tokens or any(t.gateway_cpu_s is None for t in mine):
        return None
    return sum(t.gateway_cpu_s or 0.0 for t in mine) / tokens * 1e6


def counts(turns: Sequence[Turn], target: str, clients: int) -> tuple[int, int]:
    """The target's requests at this level, and how many of them failed."""
    samples = [s for t in turns if t.target == target and t.clients == clients for s in t.samples]
    return len(samples), sum(s.error is not None for s in samples)


def summarize(
    turns: Sequence[Turn], levels: Sequence[int], gateways: Sequence[str]
) -> dict[int, dict[str, Any]]:
    """Per level: each gateway's median-over-rounds added latency and CPU per token, the
    direct p50/p99 (median over rounds), and the p99 ratios with the goal's verdict."""
    out: dict[int, dict[str, Any]] = {}
    for n in levels:
        direct = [t.stats() for t in turns if t.target == DIRECT and t.clients == n]
        level: dict[str, Any] = {
            DIRECT: {k: median([s[k] for s in direct]) for k in direct[0]}
            if direct else {},
        }  # fmt: skip
        for gw in gateways:
            per_round = added_per_round(turns, gw, n)
            level[gw] = {f"added_{k}_ms": median(v) for k, v in per_round.items()}
            level[gw]["added_per_round_ms"] = per_round
            level[gw]["cpu_us_per_token"] = cpu_us_per_token(turns, gw, n)
            level[gw]["requests"], level[gw]["failed"] = counts(turns, gw, n)
        if QUANTROUTE in level and LITELLM in level:
            qr, ll = level[QUANTROUTE], level[LITELLM]
            for m in METRICS:
                r = ratio(qr[f"added_{m}_p99_ms"], ll[f"added_{m}_p99_ms"])
                level[f"ratio_{m}_p99"] = r
                level[f"goal_{m}_p99"] = goal_met(r)
        out[n] = level
    return out


def failures(turns: Sequence[Turn], max_tokens: int) -> list[str]:
    """What makes the run's numbers wrong: errors, token counts, texts unlike direct's."""
    out = []
    reference: dict[int, str] = {}
    for t in turns:
        if t.target == DIRECT:
            for s in t.samples:
                if s.text is not None and s.error is None:
                    reference.setdefault(s.prompt, s.text)
    for t in turns:
        where = f"{t.target}, {t.clients} client(s), round {t.index + 1}"
        errors = [s.error for s in t.samples if s.error is not None]
        if errors:
            out.append(f"{where}: {len(errors)} failed request(s), e.g. {errors[0]}")
        wrong = [s.tokens for s in t.samples if s.error is None and s.tokens != max_tokens]
        if wrong:
            out.append(f"{where}: {len(wrong)} stream(s) not of {max_tokens} tokens: {wrong[:3]}")
        differ = [
            s.prompt for s in t.samples
            if s.text is not None and s.prompt in reference and s.text != reference[s.prompt]
        ]  # fmt: skip
        if differ:
            out.append(f"{where}: {len(differ)} text(s) unlike llama-server's own")
    return out


# -- configuration (pure) ---------------------------------------------------------------


def litellm_config(model: str, api_base: str) -> str:
    """LiteLLM's proxy config: one model over llama-server's OpenAI API, logging off, no key
    (as quantroute runs here: open mode; LiteLLM refuses to start without a master key
    unless told to)."""
    return (
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {api_base}\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  set_verbose: false\n"
        "  json_logs: false\n"
        "  turn_off_message_logging: true\n"
        "  request_timeout: 600\n"
        "general_settings:\n"
        "  dangerously_permit_weak_or_unset_master_key: true\n"
        "  disable_spend_logs: true\n"
        "  disable_error_logs: true\n"
    )


def quantroute_manifest(
    model: str, url: str, remote_model: str, precision: str, max_connections: int
) -> str:
    """A manifest with one remote branch (``engine: openai``) and nothing else. Its pool
    (``remote.max_connections``, 64 by default) is sized above the most clients: its
    health probe shares that pool, and with every connection streaming the probe waits,
    times out (4 s) and takes the branch out (503s) while the server is fine."""
    return (
        f"model: {model}\n"
        "reference: remote\n"
        "description: llama-server behind quantroute's remote engine (bench_gateway.py)\n"
        "branches:\n"
        "  remote:\n"
        "    engine: openai\n"
        f"    url: {url}\n"
        f"    precision: {precision}\n"
        f"    remote_model: {remote_model}\n"
        f"    remote: {{server: llama-server, max_connections: {max_connections}}}\n"
    )


def chat_body(model: str, prompt: str, max_tokens: int, eos: int) -> bytes:
    return json.dumps({
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.0, "logit_bias": {str(eos): BAN},
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip


# -- targets ----------------------------------------------------------------------------


@dataclass(slots=True)
class Target:
    """One way to reach llama-server: its server process (none for direct) and port."""

    name: str
    port: int
    model: str
    server: Server | None = None
    reuse: bool = True  # keep connections alive between requests
    idle: list[Connection] = field(default_factory=list)
    retries: int = 0

    def cpu_s(self) -> float | None:
        if self.server is None or self.server.proc is None:
            return None
        return tree_cpu_s(self.server.proc.pid)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def request(self, body: bytes, prompt: int, keep_text: bool) -> Sample:
        """One streamed chat request; a kept-alive connection the server had closed gets
        no response and is sent again once on a new one, timed from the new send.

        llama-server closes the connection after each stream (its ``Keep-Alive`` header
        notwithstanding), so the direct target connects before the clock starts: no
        measured time includes a connect (the gateways' clients keep theirs alive); what a
        gateway's own pool pays to reach llama-server is the gateway's cost."""
        while self.idle and self.idle[-1].reader.at_eof():
            self.idle.pop().close()
        conn = self.idle.pop() if self.idle else Connection("127.0.0.1", self.port)
        if conn.writer is None and not self.reuse:
            await conn._connect()  # before the clock: see above
        try:
            sample, stale = await self._once(conn, body, prompt, keep_text)
            if stale:
                self.retries += 1
                conn = Connection("127.0.0.1", self.port)
                sample, _ = await self._once(conn, body, prompt, keep_text)
        except BaseException:
            conn.close()
            raise
        if conn.writer is not None and self.reuse:
            self.idle.append(conn)
        else:
            conn.close()
        return sample

    async def _once(
        self, conn: Connection, body: bytes, prompt: int, keep_text: bool
    ) -> tuple[Sample, bool]:
        sample = Sample(prompt)
        text: list[str] = []
        sent = time.perf_counter()
        try:
            resp = await conn.post("/v1/chat/completions", body)
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return sample, False
            async for line in resp.lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                # Cheap on the client: parse a chunk only while the first content is due,
                # for the usage, or when this request's text is kept.
                if sample.ttft_s is None or keep_text or b'"completion_tokens"' in line:
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        sample.tokens = int(chunk["usage"]["completion_tokens"])
                    for choice in chunk.get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if sample.ttft_s is None:
                                sample.ttft_s = now - sent
                            text.append(content)
            sample.e2e_s = time.perf_counter() - sent
        except ConnectionClosed:
            return sample, True
        except (OSError, ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            conn.close()
            sample.error = f"{type(exc).__name__}: {exc}"
        if sample.error is None and sample.ttft_s is None:
            sample.error = "no content"
        elif sample.error is None and sample.tokens is None:
            sample.error = "no usage"
        if keep_text:
            sample.text = "".join(text)
        return sample, False


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def llama_server(binary: Path, model: Path, slots: int, n_ctx: int, cpus: str | None,
                 logs: Path) -> Server:  # fmt: skip
    """llama.cpp's server: one thread, ``slots`` slots of ``n_ctx``, prompt cache off.

    Its HTTP threads: each open connection holds one (a stream, or a kept-alive one until
    its keep-alive ends), and its default (slots + 2) leaves a gateway's health probe
    waiting behind the streams of a full server; twice the slots and some leave room for
    a gateway's pool and probes beside the streams."""
    port = free_port()
    argv = [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", "1", "-tb", "1", "--parallel", str(slots), "-c", str(n_ctx * slots),
        "--threads-http", str(2 * slots + 16),
        "--no-kv-unified", "--cont-batching", "--no-webui",
        "--no-cache-prompt", "--cache-ram", "0", "--cache-reuse", "0",
    ]  # fmt: skip
    return Server("llama-server", pinned(argv, cpus), port, "/health", logs / "llama-server.log")


def quantroute_server(repo: Path, cpus: str | None, logs: Path) -> Server:
    port = free_port()
    argv = [
        quantroute_command(), "serve", "--repo", str(repo), "--host", "127.0.0.1",
        "--port", str(port), "--server-log-level", "warning", "--server-keepalive-s", "120",
    ]  # fmt: skip
    return Server(QUANTROUTE, pinned(argv, cpus), port, "/readyz", logs / "quantroute.log")


def litellm_server(venv: Path, config: Path, cpus: str | None, logs: Path) -> Server:
    port = free_port()
    argv = [
        "env", "LITELLM_LOG=ERROR", "LITELLM_LOCAL_MODEL_COST_MAP=True",
        str(venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
        "--port", str(port), "--num_workers", "1", "--keepalive_timeout", "120",
    ]  # fmt: skip
    return Server(LITELLM, pinned(argv, cpus), port, "/health/liveliness", logs / "litellm.log")


def litellm_version(venv: Path) -> str:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip() or "unknown"


def llama_server_binary() -> tuple[Path, dict[str, Any]]:
    """Build (once, cached) or find llama-server; its build record (revision, flags)."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), sys.executable], stdout=subprocess.PIPE, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit("llama-server build failed (see above)")
    binary = Path(done.stdout.strip().splitlines()[-1])
    return binary, json.loads((binary.parent / "build.json").read_text())


def eos_id(path: Path) -> int:
    from llama_cpp import Llama

    with contextlib.redirect_stderr(None):
        vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return int(vocab.token_eos())


# -- the run ----------------------------------------------------------------------------


async def turn(target: Target, server: Server, clients: int, requests: int, index: int,
               bodies: list[bytes]) -> Turn:  # fmt: skip
    """``requests`` requests from ``clients`` closed-loop clients; prompts in order."""
    counter = iter(range(requests))
    samples: list[Sample] = []
    kept: set[int] = set()

    async def client() -> None:
        for i in counter:
            prompt = i % len(bodies)
            keep = prompt not in kept
            kept.add(prompt)
            samples.append(await target.request(bodies[prompt], prompt, keep))

    gw0, srv0, retries0 = target.cpu_s(), server.cpu_s(), target.retries
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    gw1 = target.cpu_s()
    return Turn(
        target.name, clients, index, wall,
        None if gw0 is None or gw1 is None else gw1 - gw0,
        server.cpu_s() - srv0, target.retries - retries0, samples,
    )  # fmt: skip


async def settle(procs: Sequence[Server], timeout_s: float = 60.0) -> None:
    """Wait until the servers are idle (under 5 % of a core over half a second)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        before = sum(p.cpu_s() for p in procs)
        await asyncio.sleep(0.5)
        if sum(p.cpu_s() for p in procs) - before < 0.025:
            return
    log.warning("the servers did not go idle in %.0f s; measuring anyway", timeout_s)


def progress(turns: Sequence[Turn], n: int, index: int, rounds: int, took_s: float) -> str:
    mine = {t.target: t for t in turns if t.clients == n and t.index == index}
    parts = []
    if DIRECT in mine:
        s = mine[DIRECT].stats()
        parts.append(f"direct TTFT {fmt(s['ttft_p50_ms'], 2)}/{fmt(s['ttft_p99_ms'], 2)} ms, "
                     f"e2e {fmt(s['e2e_p50_ms'], 2)}/{fmt(s['e2e_p99_ms'], 2)}")  # fmt: skip
    for gw in GATEWAYS:
        if gw in mine and DIRECT in mine:
            a = {k: v[-1] if v else None for k, v in added_per_round(
                [mine[gw], mine[DIRECT]], gw, n).items()}  # fmt: skip
            cpu = cpu_us_per_token([mine[gw]], gw, n)
            parts.append(
                f"{gw} +{fmt(a['ttft_p50'], 2)}/+{fmt(a['ttft_p99'], 2)} TTFT, "
                f"+{fmt(a['e2e_p50'], 2)}/+{fmt(a['e2e_p99'], 2)} e2e, {fmt(cpu, 0)} µs/tok"
            )
    return f"round {index + 1}/{rounds} {n:2d} clients ({took_s:.0f} s): " + "; ".join(parts)


async def run(args: argparse.Namespace, servers: dict[str, Server], eos: int) -> list[Turn]:
    names = [t for t in TARGETS if t in args.targets]
    model = args.model_name
    targets = [
        Target(n, servers[n].port, model, None if n == DIRECT else servers[n], n != DIRECT)
        for n in names
    ]  # fmt: skip
    bodies = [chat_body(model, p, args.max_tokens, eos) for p in PROMPTS]
    ls = servers[DIRECT]
    await settle(list(servers.values()))
    for t in targets:  # warm-up, not recorded: pools, connections, caches
        await turn(t, ls, max(args.levels), max(args.levels), -1, bodies)
    turns: list[Turn] = []
    for index in range(args.rounds):
        for n in args.levels:
            start = time.perf_counter()
            shift = (index + args.levels.index(n)) % len(targets)
            for t in targets[shift:] + targets[:shift]:
                await settle(list(servers.values()))
                turns.append(await turn(t, ls, n, max(args.requests, 4 * n), index, bodies))
            log.info("%s", progress(turns, n, index, args.rounds, time.perf_counter() - start))
    for t in targets:
        t.close()
    return turns


# -- reporting --------------------------------------------------------------------------


def markdown(summary: dict[int, dict[str, Any]], gateways: Sequence[str]) -> str:
    head = (
        "| Clients | Gateway | Added TTFT p50 / p99 (ms) | Added e2e p50 / p99 (ms) | "
        "Gateway CPU per token (µs) | Failed |\n| ---: | --- | ---: | ---: | ---: | ---: |"
    )
    rows = []
    for n, level in summary.items():
        d = level[DIRECT]
        rows.append(f"| {n} | (llama-server alone: TTFT {fmt(d.get('ttft_p50_ms'), 2)} / "
                    f"{fmt(d.get('ttft_p99_ms'), 2)}, e2e {fmt(d.get('e2e_p50_ms'), 1)} / "
                    f"{fmt(d.get('e2e_p99_ms'), 1)}) | | | | |")  # fmt: skip
        for gw in gateways:
            g = level[gw]
            rows.append(
                f"| {n} | {LABELS[gw]} | {fmt(g['added_ttft_p50_ms'], 2)} / "
                f"{fmt(g['added_ttft_p99_ms'], 2)} | {fmt(g['added_e2e_p50_ms'], 2)} / "
                f"{fmt(g['added_e2e_p99_ms'], 2)} | {fmt(g['cpu_us_per_token'], 0)} | "
                f"{g['failed']} of {g['requests']} |"
            )
    return head + "\n" + "\n".join(rows)


def goal_lines(summary: dict[int, dict[str, Any]]) -> list[str]:
    out = []
    for n, level in summary.items():
        for m in METRICS:
            r = level.get(f"ratio_{m}_p99")
            met = level.get(f"goal_{m}_p99")
            verdict = "not measurable" if met is None else "met" if met else "NOT met"
            out.append(f"{n} client(s): quantroute / LiteLLM added {m} p99 = {fmt(r, 2)} "
                       f"(goal <= {GOAL_RATIO:.2f}): {verdict}")  # fmt: skip
    return out


def save_chart(summary: dict[int, dict[str, Any]], gateways: Sequence[str], caption: str,
               path: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(summary)
    xs = range(len(levels))
    colors = {QUANTROUTE: "#1f77b4", LITELLM: "#d62728"}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    width = 0.8 / (2 * len(gateways))
    for ax, m, title in ((axes[0], "ttft", "Added TTFT"), (axes[1], "e2e", "Added end-to-end")):
        for i, gw in enumerate(gateways):
            for j, q in enumerate(QS):
                k = 2 * i + j
                vals = [summary[n][gw][f"added_{m}_p{q}_ms"] or 0.0 for n in levels]
                ax.bar([x + (k - (2 * len(gateways) - 1) / 2) * width for x in xs], vals, width,
                       color=colors[gw], alpha=0.45 if q == 50 else 1.0,
                       label=f"{LABELS[gw]} p{q}")  # fmt: skip
        ax.axhline(0, color="#444", lw=0.6)
        ax.set_yscale("symlog", linthresh=10)  # 1 client's few ms and 64's seconds
        ax.set_title(f"{title} over llama-server's (ms; p50 light, p99 dark)", fontsize=9)
        ax.set_xticks(list(xs), [f"{n} client{'s' if n > 1 else ''}" for n in levels])
        ax.legend(fontsize=7)
    cw = 0.8 / len(gateways)
    for i, gw in enumerate(gateways):
        vals = [summary[n][gw]["cpu_us_per_token"] or 0.0 for n in levels]
        axes[2].bar([x + (i - (len(gateways) - 1) / 2) * cw for x in xs], vals, cw,
                    color=colors[gw], label=LABELS[gw])  # fmt: skip
    axes[2].set_title("Gateway CPU per streamed token (µs, process tree)", fontsize=9)
    axes[2].set_xticks(list(xs), [str(n) for n in levels])
    axes[2].margins(y=0.2)
    axes[2].legend(fontsize=7, loc="upper left")
    for m, marker in (("ttft", "o"), ("e2e", "s")):
        vals = [summary[n].get(f"ratio_{m}_p99") for n in levels]
        axes[3].plot(list(xs), [math.nan if v is None else v for v in vals], marker=marker,
                     label=f"added {m} p99")  # fmt: skip
    axes[3].axhline(GOAL_RATIO, color="#2ca02c", ls="--", label="goal: at most 1/3")
    axes[3].set_title("quantroute added p99 / LiteLLM added p99", fontsize=9)
    axes[3].set_xticks(list(xs), [str(n) for n in levels])
    axes[3].legend(fontsize=7)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_avg_at_start": os.getloadavg()}  # fmt: skip


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="clients")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=160, help="per turn (at least 4 a client)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", type=Path, help="GGUF file (default: tiny-llama's q8_0)")
    p.add_argument("--model-name", default="tiny-llama", help="the name every target serves")
    p.add_argument("--precision", default="q8_0", help="the remote branch's precision")
    p.add_argument("--n-ctx", type=int, default=256, help="context per llama-server slot")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary (default: build it)")
    p.add_argument("--litellm", type=Path, default=DEFAULT_LITELLM, help="LiteLLM's venv")
    p.add_argument("--no-pin", action="store_true", help="leave the CPUs unpinned")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/gateway-cost-...)")
    p.add_argument("--chart", type=Path, help="PNG (default docs/img/bench_gateway_<date>.png)")
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--replot", type=Path, help="a run's JSON: its table and chart again")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2 or min(args.levels) < 1:
        p.error("--rounds and --levels must be >= 1, --max-tokens >= 2")
    if DIRECT not in args.targets:
        p.error("--targets needs direct: added latency is measured against it")
    args.levels = sorted(set(args.levels))
    return args


def cpu_sets(no_pin: bool) -> tuple[str | None, str | None]:
    """(llama-server's, the gateways' and the client's): the first core, the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if no_pin or len(cpus) < 2 or shutil.which("taskset") is None:
        return None, None
    return str(cpus[0]), ",".join(str(c) for c in cpus[1:])


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through the finally that stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.chart)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.llama_server is None:
        args.llama_server, build = llama_server_binary()
    else:
        record = args.llama_server.parent / "build.json"
        build = json.loads(record.read_text()) if record.is_file() else {}
    model = args.model or DEMO_REPO / "tiny-llama" / f"{args.precision}.gguf"
    eos = eos_id(model)
    server_cpus, gateway_cpus = cpu_sets(args.no_pin)
    if gateway_cpus is not None:
        os.sched_setaffinity(0, {int(c) for c in gateway_cpus.split(",")})
    now = dt.datetime.now().astimezone()
    stamp = f"{now:%Y-%m-%dT%H%M}"
    logs = RESULTS_DIR / "logs" / f"gateway-cost-{stamp}"
    versions = {"litellm": litellm_version(args.litellm)} if LITELLM in args.targets else {}
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="qr-bench-gw-") as tmp:
        try:
            slots = max(args.levels)
            ls = llama_server(args.llama_server, model, slots, args.n_ctx, server_cpus, logs)
            servers[DIRECT] = ls
            api_base = f"{ls.base_url}/v1"
            if QUANTROUTE in args.targets:
                repo = Path(tmp) / "repo"
                (repo / args.model_name).mkdir(parents=True)
                manifest = quantroute_manifest(
                    args.model_name, api_base, args.model_name, args.precision, 2 * slots
                )
                (repo / args.model_name / "quantroute.yaml").write_text(manifest)
                servers[QUANTROUTE] = quantroute_server(repo, gateway_cpus, logs)
            if LITELLM in args.targets:
                config = Path(tmp) / "litellm.yaml"
                config.write_text(litellm_config(args.model_name, api_base))
                servers[LITELLM] = litellm_server(args.litellm, config, gateway_cpus, logs)
            for s in servers.values():
                s.start()
                s.wait_ready(args.start_timeout_s)
            log.info(
                "llama-server on CPU %s, gateways and client on %s; litellm %s; %d round(s), "
                "levels %s, %d tokens a request",
                server_cpus or "any", gateway_cpus or "any", versions.get("litellm", "-"),
                args.rounds, args.levels, args.max_tokens,
            )  # fmt: skip
            turns = uvloop.run(run(args, servers, eos))
        except KeyboardInterrupt:
            log.warning("interrupted; the servers are stopped")
            return 130
        finally:
            for s in reversed(list(servers.values())):
                s.stop()

    gateways = [g for g in GATEWAYS if g in args.targets]
    summary = summarize(turns, args.levels, gateways)
    failed = failures(turns, args.max_tokens)
    report = {
        "date": now.isoformat(timespec="seconds"), "machine": machine(),
        "llama_server": build, "versions": versions,
        "cpus": {"llama-server": server_cpus, "gateways_and_client": gateway_cpus},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": {str(n): v for n, v in summary.items()}, "failures": failed,
        "turns": [t.record() for t in turns],
    }  # fmt: skip
    print(f"\n{caption(report)}\n\n{markdown(summary, gateways)}\n")
    print("\n".join(goal_lines(summary)))
    for f in failed:
        log.error("FAILED: %s", f)
    out = args.out or RESULTS_DIR / f"gateway-cost-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s", out)
    if not args.no_chart:
        chart = args.chart or ROOT / "docs" / "img" / f"bench_gateway_{now:%Y-%m-%d}.png"
        save_chart(summary, gateways, caption(report), chart)
        log.info("wrote %s", chart)
    return 1 if failed else 0


def caption(report: dict[str, Any]) -> str:
    """One line: when, where, what was run (the chart's title, the table's heading)."""
    when = dt.datetime.fromisoformat(report["date"])
    host, a = report["machine"], report["settings"]
    revision = str(report["llama_server"].get("revision", "unknown"))[:9]
    return (
        f"{when:%Y-%m-%d %H:%M %Z}, {host['cpu']} ({host['cpus']} CPUs); tiny-llama "
        f"{a['precision']}, llama-server 1 thread, {max(a['levels'])} slots, llama.cpp "
        f"{revision}; {a['rounds']} round(s), >= {a['requests']} requests a turn, "
        f"{a['max_tokens']} tokens; LiteLLM {report['versions'].get('litellm', '-')}, 1 worker"
    )


def replot(path: Path, chart: Path | None) -> int:
    """The table, goals and chart again from a run's JSON (no servers)."""
    report = json.loads(path.read_text())
    summary = {int(n): v for n, v in report["summary"].items()}
    gateways = [g for g in GATEWAYS if g in report["settings"]["targets"]]
    print(f"{caption(report)}\n\n{markdown(summary, gateways)}\n")
    print("\n".join(goal_lines(summary)))
    day = dt.datetime.fromisoformat(report["date"])
    chart = chart or ROOT / "docs" / "img" / f"bench_gateway_{day:%Y-%m-%d}.png"
    save_chart(summary, gateways, caption(report), chart)
    print(f"wrote {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

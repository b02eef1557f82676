"""What ``bench_fleet.py`` starts and how it talks to it: the engines (one ``llama-server``
per precision of the demo model), one etcd, one redis-server, the gateways (``quantroute
serve`` with the engines as remote branches, a tenants file, and the cluster paths a
configuration names), and a lean streaming client that sends a tenant's key.

Every process is a :class:`servers.Server`: a session of its own on a free loopback port,
logging to a file, always stopped. (The etcd and Redis start-up follows
``tests/cluster_servers.py``'s ``EtcdServer`` and ``RedisServer``, copied rather than
imported: benchmarks do not import tests.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from quantroute.config import DEMO_REPO
from servers import Server, free_port, quantroute_command

log = logging.getLogger("bench_fleet")

MODEL = "tiny-llama"
TENANT, KEY, ADMIN_KEY = "bench", "sk-bench-fleet", "sk-bench-fleet-admin"
BAN = -100.0  # the logit bias that keeps a token from ever being chosen
PRECISIONS = ("f16", "q8_0", "q4_k_m")
# the demo's own measured fidelity of its q8_0 and q4_k_m, declared for the remote branches
DECLARED = {"q8_0": (0.00036, 0.989), "q4_k_m": (0.0140, 0.933)}
# the cluster paths a gateway runs with: none, etcd (drains, traffic rules, tenants), and
# etcd with Redis (streams copied, tenant limits counted for the fleet)
OFF, ETCD, REDIS = "off", "etcd", "etcd+redis"
CONFIGS = (OFF, ETCD, REDIS)
# every device tight (as tests/e2e/test_remote_branches.py sets it): the cheapest branch
# within a tier's bound serves it, so the tiers spread the requests over the engines
# (balanced: q4_k_m, high: q8_0, exact: f16); ample (the default: an empty remote KV cache
# is ample) sends every tier to the most faithful, f16
TIGHT = ("--routing-ample-free-bytes", str(1 << 50), "--routing-tight-free-bytes", str(1 << 50))


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


# -- the engines, etcd, Redis -----------------------------------------------------------


def engine_server(binary: Path, precision: str, slots: int, http_threads: int,
                  cpus: str | None, logs: Path) -> Server:  # fmt: skip
    """llama.cpp's server on the demo model's ``precision`` file: one thread, ``slots``
    slots of 256 tokens, ``--metrics`` (the gateways read each server's load from it).
    ``http_threads``: each open connection holds one, and every gateway of the largest
    fleet has its own pool.

    Its prompt cache stays on (llama-server's default): the byte-level demo model's chat
    template makes a short prompt ~70 tokens, 12 ms of prefill on one thread, which would
    make the engines, not the gateways, what limits the rate; a slot that served the same
    prompt before reuses it, as a shared system prompt would be."""
    port = free_port()
    argv = [
        str(binary), "-m", str(DEMO_REPO / MODEL / f"{precision}.gguf"),
        "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
        "--parallel", str(slots), "-c", str(256 * slots), "--threads-http", str(http_threads),
        "--no-kv-unified", "--cont-batching", "--no-webui", "--metrics",
    ]  # fmt: skip
    return Server(f"llama-server {precision}", pinned(argv, cpus), port, "/health",
                  logs / f"llama-server-{precision}.log")  # fmt: skip


def etcd_server(data: Path, cpus: str | None, logs: Path) -> Server:
    """A one-member etcd on free loopback ports, its data in ``data``."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("needs etcd on the PATH")
    port, peer = free_port(), f"http://127.0.0.1:{free_port()}"
    url = f"http://127.0.0.1:{port}"
    argv = [etcd, "--name", "default", "--data-dir", str(data),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--logger", "zap", "--log-level", "error"]  # fmt: skip
    return Server("etcd", pinned(argv, cpus), port, "/health", logs / "etcd.log")


def redis_server(cpus: str | None, logs: Path) -> Server:
    """A redis-server of its own on a loopback port, nothing saved (ready: :func:`ping`)."""
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("needs redis-server on the PATH")
    port = free_port()
    argv = [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return Server("redis", pinned(argv, cpus), port, "", logs / "redis.log")


def ping(server: Server, timeout_s: float = 20.0) -> None:
    """Wait until the redis-server answers ``PING``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", server.port), timeout=1) as s,
        ):
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError("redis-server did not answer" + server.tail())


def etcd_put_tenant(etcd: Server, cluster: str, rpm: int, tpm: int) -> None:
    """The tenant into etcd (sha256 of its key, as docs/cluster.md has it): the gateways
    that read etcd serve with etcd's tenants, as a fleet does."""
    value = {"keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
             "requests_per_minute": rpm, "tokens_per_minute": tpm, "max_concurrency": 100_000,
             "models": [MODEL]}  # fmt: skip
    b64 = [base64.b64encode(x.encode()).decode() for x in (f"/{cluster}/tenants/{TENANT}",
                                                             json.dumps(value))]  # fmt: skip
    r = httpx.post(f"{etcd.base_url}/v3/kv/put", json={"key": b64[0], "value": b64[1]}, timeout=10)
    r.raise_for_status()


# -- the gateways -----------------------------------------------------------------------


def manifest(urls: dict[str, str], max_connections: int) -> str:
    """``tiny-llama`` with each precision in ``urls`` a remote branch at its llama-server:
    the first the reference, q8_0 and q4_k_m (when not the reference) with the demo's own
    measured fidelity declared (the servers' logprobs are not profiled here)."""
    reference = next(iter(urls))
    lines = [f"model: {MODEL}", f"reference: {reference}",
             "description: the demo model's precisions on llama-servers (bench_fleet.py)",
             "branches:"]  # fmt: skip
    for precision, url in urls.items():
        remote = f"{{server: llama-server, max_connections: {max_connections}}}"
        lines += [f"  {precision}:", "    engine: openai", f"    url: {url}",
                  f"    precision: {precision}", f"    remote_model: {precision}",
                  f"    remote: {remote}"]  # fmt: skip
        if precision in DECLARED and precision != reference:
            kld, top1 = DECLARED[precision]
            lines.append(f"    profile: {{mean_kld: {kld}, top1: {top1}}}")
    return "\n".join(lines) + "\n"


def tenants_file(rpm: int, tpm: int) -> str:
    """One tenant with per-minute limits far above the run's (so the limit path runs on
    every request and never refuses one)."""
    return (
        f"tenants:\n  {TENANT}:\n    keys: [{KEY}]\n    requests_per_minute: {rpm}\n"
        f"    tokens_per_minute: {tpm}\n    max_concurrency: 100000\n    models: [{MODEL}]\n"
    )


def gateway_server(name: str, repo: Path, tenants: Path, config: str, etcd: Server | None,
                   redis: Server | None, cluster: str, cpus: str | None,
                   logs: Path) -> Server:  # fmt: skip
    """``quantroute serve`` over ``repo`` with the tenants file and the cluster paths of
    ``config`` (:data:`CONFIGS`)."""
    port = free_port()
    argv = [
        quantroute_command(), "serve", "--repo", str(repo), "--host", "127.0.0.1",
        "--port", str(port), "--server-log-level", "warning", "--server-keepalive-s", "120",
        "--auth-tenants-file", str(tenants), "--server-admin-key", ADMIN_KEY,
        "--repository-watch", "false", *TIGHT,
    ]  # fmt: skip
    if config in (ETCD, REDIS):
        assert etcd is not None
        argv += ["--cluster-etcd-endpoints", etcd.base_url, "--cluster-name", cluster]
    if config == REDIS:
        assert redis is not None
        argv += ["--cluster-redis-url", f"redis://127.0.0.1:{redis.port}/0"]
    return Server(name, pinned(argv, cpus), port, "/readyz", logs / f"{name}.log")


def wait_routable(gateway: Server, config: str, timeout_s: float = 60.0) -> dict[str, object]:
    """Wait until every branch is ready and the cluster paths are what ``config`` says
    (etcd read and its tenant in force; Redis up); ``/admin/status``'s ``cluster`` and
    ``redis`` sections then."""
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + timeout_s
    status: dict[str, object] = {}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=5) as c:
        while time.monotonic() < deadline:
            models = c.get("/v1/models").json()["data"]
            ready = all(b["ready"] for m in models for b in m.get("branches", ()))
            full = c.get("/admin/status").json()
            status = {"cluster": full.get("cluster"), "redis": full.get("redis")}
            if ready and _paths_ok(status, config):
                return status
            time.sleep(0.2)
    raise RuntimeError(f"{gateway.name} not routable as {config!r}: {status}" + gateway.tail())


def redis_status(gateway: Server) -> object:
    """The gateway's ``/admin/status`` Redis section (``None`` without Redis): its
    ``local_checks`` say how many limit checks did not go through Redis."""
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return (
        httpx.get(f"{gateway.base_url}/admin/status", headers=headers, timeout=5)
        .json()
        .get("redis")
    )


def _paths_ok(status: dict[str, object], config: str) -> bool:
    if config == OFF:
        return True
    cluster, redis = status.get("cluster"), status.get("redis")
    etcd_ok = isinstance(cluster, dict) and cluster.get("state") == "connected" and (
        (cluster.get("tenants") or {}).get("source") == "etcd"
    )  # fmt: skip
    redis_ok = isinstance(redis, dict) and redis.get("redis") == "up"
    return etcd_ok and (config == ETCD or redis_ok)


# -- the client -------------------------------------------------------------------------


def arrivals(rate: float, span_s: float, seed: int) -> list[float]:
    """Poisson arrival times (s from the start) over ``span_s``, the same for a seed."""
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < span_s:
        out.append(t)
    return out


def chat_body(prompt: str, max_tokens: int, eos: int, quality: str | None) -> bytes:
    """A greedy streamed chat request of exactly ``max_tokens`` tokens (end of sequence
    banned), with its usage; ``quality``: the tier it asks for (none: the default)."""
    body: dict[str, object] = {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0.0, "logit_bias": {str(eos): BAN},
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if quality is not None:
        body["quality"] = quality
    return json.dumps(body).encode()


@dataclass(slots=True)
class Sample:
    """One streamed request as the client saw it (seconds from its send)."""

    gateway: int
    lag_s: float = 0.0  # sent this late after it was due (open-loop arrivals)
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int | None = None
    branch: str | None = None
    error: str | None = None


class _Stale(ConnectionError):
    """A kept-alive connection the server had closed: no response began."""


@dataclass(slots=True)
class Client:
    """Streamed chat requests to gateways on loopback, with the tenant's key; kept-alive
    connections per gateway, HTTP/1.1 with chunked bodies only (what uvicorn streams).
    Much cheaper per chunk than httpx (``lean_http.py``'s reasoning: the client shares the
    machine with what it measures), and it sends the ``Authorization`` header."""

    ports: list[int]
    tokens: int  # every stream has exactly these many, or it is an error
    timeout_s: float = 60.0
    idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(
        default_factory=dict
    )

    def close(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()

    async def send(self, gateway: int, body: bytes, lag_s: float = 0.0) -> Sample:
        """One streamed request to gateway number ``gateway``; a kept-alive connection the
        server had closed is replaced once, the request timed again from its new send."""
        port = self.ports[gateway]
        pool = self.idle.setdefault(port, [])
        for attempt in (0, 1):
            sample = Sample(gateway, lag_s)
            reused = bool(pool) and attempt == 0
            sent = time.perf_counter()
            try:
                conn = pool.pop() if reused else await asyncio.open_connection("127.0.0.1", port)
            except OSError as exc:
                sample.error = f"connect: {exc}"
                return sample
            try:
                async with asyncio.timeout(self.timeout_s):
                    keep = await self._exchange(conn, body, sample, sent)
            except _Stale:
                conn[1].close()
                if reused:
                    continue
                sample.error = "closed without a response"
            except (OSError, ValueError, KeyError, EOFError) as exc:  # TimeoutError: an OSError
                conn[1].close()
                sample.error = f"{type(exc).__name__}: {exc}"
            else:
                if keep:
                    pool.append(conn)
                else:
                    conn[1].close()
            break
        if sample.error is None and sample.ttft_s is None:
            sample.error = "no content"
        elif sample.error is None and sample.tokens != self.tokens:
            sample.error = f"{sample.tokens} tokens, not {self.tokens}"
        return sample

    async def _exchange(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                        body: bytes, sample: Sample, sent: float) -> bool:  # fmt: skip
        """One request on ``conn``; whether the connection may be kept."""
        reader, writer = conn
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            await writer.drain()
            status_line = await reader.readline()
        except ConnectionError as exc:
            raise _Stale(str(exc)) from exc
        if not status_line:
            raise _Stale("no status line")
        status = int(status_line.split(None, 2)[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        sample.branch = headers.get("x-quantroute-branch")
        if status != 200 or "chunked" not in headers.get("transfer-encoding", ""):
            length = int(headers.get("content-length", "0"))
            text = await reader.readexactly(length) if length else b""
            sample.error = f"HTTP {status}: {text[:200]!r}"
            return False
        pending = b""
        while size := int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._line(line, sample, sent)
        await reader.readline()  # the last chunk's empty line
        sample.e2e_s = time.perf_counter() - sent
        return headers.get("connection", "").lower() != "close"

    @staticmethod
    def _line(line: bytes, sample: Sample, sent: float) -> None:
        # Parse a chunk only while the first content is due, or for the usage.
        if not line.startswith(b"data: {"):
            return
        if sample.ttft_s is None:
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    sample.ttft_s = now - sent
                    break
        if b'"completion_tokens"' in line:
            usage = json.loads(line[6:]).get("usage")
            if usage:
                sample.tokens = int(usage["completion_tokens"])


# -- the fleet's shared parts, CPUs -----------------------------------------------------


def cpu_sets(no_pin: bool) -> tuple[str | None, str | None]:
    """(everything but the gateways, the gateways): the other cores, the last core."""
    cpus = sorted(os.sched_getaffinity(0))
    if no_pin or len(cpus) < 2 or shutil.which("taskset") is None:
        return None, None
    return ",".join(str(c) for c in cpus[:-1]), str(cpus[-1])


class Meter:
    """CPU seconds so far of named groups of processes (each a process tree) and of this
    process (the client)."""

    def __init__(self, procs: dict[str, list[Server]]):
        self.procs = procs
        self.me = psutil.Process()

    def read(self) -> dict[str, float]:
        out = {name: sum(p.cpu_s() for p in group) for name, group in self.procs.items()}
        times = self.me.cpu_times()
        out["client"] = times.user + times.system
        return out

    @staticmethod
    def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: after[k] - before[k] for k in before}

    async def settle(self, limit_s: float = 20.0) -> None:
        """Wait until the engines, etcd and Redis are idle: under 5 % of a core together
        over half a second. (Not the gateways: each spends ~2 % idle on its probes.)"""
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            before = self.read()
            await asyncio.sleep(0.5)
            used = self.since(before, self.read())
            if sum(v for k, v in used.items() if k in ("engines", "etcd", "redis")) < 0.025:
                return
        log.warning("the servers did not go idle in %.0f s; measuring anyway", limit_s)


@dataclass(slots=True)
class Backends:
    """What every gateway of every fleet shares — the engines, etcd, Redis, the repository
    and the tenants file, all under ``root`` — and the gateways running now."""

    root: Path
    cluster: str
    cpus: str | None  # the engines', etcd's and Redis's
    gateway_cpus: str | None
    logs: Path
    start_timeout_s: float
    engines: list[Server] = field(default_factory=list)
    etcd: Server | None = None
    redis: Server | None = None
    gateways: list[Server] = field(default_factory=list)

    def start(self, binary: Path, precisions: Sequence[str], slots: int, most_gateways: int,
              limits: tuple[int, int]) -> None:  # fmt: skip
        """The engines, one per precision (``slots`` each; HTTP threads for ``most_gateways``
        pools of as many), etcd with the tenant, Redis; the repository and tenants file."""
        threads = most_gateways * slots + 16
        self.engines = [engine_server(binary, p, slots, threads, self.cpus, self.logs)
                        for p in precisions]  # fmt: skip
        self.etcd = etcd_server(self.root / "etcd", self.cpus, self.logs)
        self.redis = redis_server(self.cpus, self.logs)
        for s in [*self.engines, self.etcd, self.redis]:
            s.start()
        ping(self.redis)
        for s in [*self.engines, self.etcd]:
            s.wait_ready(self.start_timeout_s)
        etcd_put_tenant(self.etcd, self.cluster, *limits)
        folder = self.root / "repo" / MODEL
        folder.mkdir(parents=True)
        urls = {p: f"{s.base_url}/v1" for p, s in zip(precisions, self.engines, strict=True)}
        (folder / "quantroute.yaml").write_text(manifest(urls, slots))
        (self.root / "tenants.yaml").write_text(tenants_file(*limits))

    def start_gateways(self, configs: Sequence[str], names: Sequence[str]) -> list[Server]:
        """Gateways of these configurations, started together; each routable as configured."""
        self.gateways = [
            gateway_server(name, self.root / "repo", self.root / "tenants.yaml", config,
                           self.etcd, self.redis, self.cluster, self.gateway_cpus, self.logs)
            for name, config in zip(names, configs, strict=True)
        ]  # fmt: skip
        for g in self.gateways:
            g.start()
        for g, config in zip(self.gateways, configs, strict=True):
            g.wait_ready(self.start_timeout_s)
            wait_routable(g, config)
        return self.gateways

    def meter(self, serving: Sequence[Server] | None = None) -> Meter:
        """A meter of the engines (together), etcd, Redis, each ``serving`` gateway (all
        running, by default) by its name, the other running gateways together (``idle``)
        and this client."""
        serving = self.gateways if serving is None else serving
        procs: dict[str, list[Server]] = {"engines": self.engines}
        procs.update((s.name, [s]) for s in (self.etcd, self.redis, *serving) if s)
        procs["idle"] = [g for g in self.gateways if g not in serving]
        return Meter(procs)

    def stop_gateways(self) -> None:
        for s in reversed(self.gateways):
            s.stop()
        self.gateways = []

    def stop(self) -> None:
        self.stop_gateways()
        for s in reversed([*self.engines, self.etcd, self.redis]):
            if s is not None:
                s.stop()


def revision() -> str:
    """The commit this tree is at, and how many files differ from it (others' work too)."""

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
        )
        return done.stdout.strip()

    changed = len(git("status", "--short", "--untracked-files=no").splitlines())
    return f"{git('rev-parse', '--short', 'HEAD')} (+{changed} changed files)"

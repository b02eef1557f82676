"""What the Redis paths cost, against a real redis-server on loopback.

Run from the repository root: ``.venv/bin/python benchmarks/bench_redis.py`` (needs
``redis-server`` on the PATH; it starts its own on a free loopback port).

1. A streamed request over real HTTP (uvicorn in-process, the real app over a fake engine
   of 64 tokens, no delay), sequentially: wall time per request without and with the
   stream copied to Redis (the launcher's wiring), median and p90, and the gateway
   process's CPU per request.
2. The stream store alone: CPU per streamed request of 64 events, without / with a copy.
3. A limit check: TenantLimits.check + started (local) against RedisTenantLimits.admit.
4. A resume on another gateway: lookup + the first events (time to the first event).
5. CPU per token with 32 streams at once, a token every 20 ms each, without / with copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from qrtest import StreamSource, fake_table, free_port, live
from quantroute.api.app import create_app
from quantroute.cluster.redis_limits import RedisTenantLimits
from quantroute.cluster.redis_link import RedisLink
from quantroute.cluster.redis_streams import StreamReplicator
from quantroute.config import StreamSettings, load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.resilience.resume import StreamStore
from quantroute.resilience.tenants import Tenant, TenantLimits

N_HTTP = 300
N_STORE = 2000
N_CHECKS = 3000
TOKENS = 64


async def _drained(replicator: StreamReplicator) -> None:
    while not replicator.idle:  # noqa: ASYNC110 (what it waits for has no event)
        await asyncio.sleep(0.001)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _row(name: str, xs: list[float], unit: float = 1e3, u: str = "ms") -> None:
    print(
        f"| {name} | {statistics.median(xs) * unit:.3f} {u} | {_pct(xs, 0.9) * unit:.3f} {u} "
        f"| {_pct(xs, 0.99) * unit:.3f} {u} |"
    )


async def http_streams(url: str | None) -> tuple[list[float], float]:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, limits={"max_tokens": 128})
    text = "".join(chr(97 + i % 26) for i in range(TOKENS))
    engines = {n: FakeEngine(text) for n in ("f16", "q8_0", "q4_k_m")}
    app = create_app(settings, fake_table(engines))
    link = replicator = None
    if url is not None:
        link = RedisLink(url, "bench")
        await link.start()
        replicator = StreamReplicator(link, settings.streams)
        replicator.start()
        app.state.streams = StreamStore(settings.streams, replicator)
    body = {"model": "tiny-llama", "stream": True, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    times: list[float] = []
    async with live(app) as port, httpx.AsyncClient(timeout=30) as c:
        base = f"http://127.0.0.1:{port}"
        for i in range(N_HTTP + 20):
            t0 = time.perf_counter()
            async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                got = b""
                async for chunk in r.aiter_bytes():
                    got += chunk
            assert b"[DONE]" in got
            if i >= 20:
                times.append(time.perf_counter() - t0)
        cpu0 = time.process_time()
        for _ in range(100):
            async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                async for _chunk in r.aiter_bytes():
                    pass
        cpu = (time.process_time() - cpu0) / 100
    await app.state.streams.close()
    if replicator is not None and link is not None:
        await replicator.close()
        await link.close()
    return times, cpu


async def store_cpu(url: str | None) -> float:
    settings = StreamSettings()
    link = replicator = None
    if url is not None:
        link = RedisLink(url, "bench")
        await link.start()
        replicator = StreamReplicator(link, settings)
        replicator.start()
    store = StreamStore(settings, replicator)
    cpu0 = time.process_time()
    for i in range(N_STORE):
        source = StreamSource()
        stream = store.open(f"s{i}", "acme", source.events(), close=source.close, grace_s=0)
        for t in range(TOKENS):
            source.put(b'{"choices":[{"delta":{"content":"%d"}}]}' % t)
        source.put_together(b"[DONE]")
        source.finish()
        async for _ in stream.follow(None):
            pass
    if replicator is not None:
        await _drained(replicator)
    cpu = (time.process_time() - cpu0) / N_STORE
    await store.close()
    if replicator is not None and link is not None:
        await replicator.close()
        await link.close()
    return cpu


async def store_cpu_paced(url: str | None, streams: int = 32, gap_s: float = 0.02) -> float:
    """CPU per token with ``streams`` streams at once, a token every ``gap_s`` each."""
    settings = StreamSettings()
    link = replicator = None
    if url is not None:
        link = RedisLink(url, "bench")
        await link.start()
        replicator = StreamReplicator(link, settings)
        replicator.start()
    store = StreamStore(settings, replicator)

    async def one(i: int) -> None:
        source = StreamSource()
        stream = store.open(f"p{i}", "acme", source.events(), close=source.close, grace_s=0)

        async def produce() -> None:
            for t in range(TOKENS):
                source.put(b'{"choices":[{"delta":{"content":"%d"}}]}' % t)
                await asyncio.sleep(gap_s)
            source.put_together(b"[DONE]")
            source.finish()

        task = asyncio.create_task(produce())
        async for _ in stream.follow(None):
            pass
        await task

    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(streams)))
    if replicator is not None:
        await _drained(replicator)
    cpu = (time.process_time() - cpu0) / (streams * TOKENS)
    await store.close()
    if replicator is not None and link is not None:
        await replicator.close()
        await link.close()
    return cpu


async def checks(url: str) -> tuple[list[float], list[float]]:
    acme = Tenant("acme", requests_per_minute=10**9, tokens_per_minute=10**12)
    local = TenantLimits()
    lt = []
    for _ in range(N_CHECKS):
        t0 = time.perf_counter()
        assert local.check(acme) is None
        local.started(acme)
        lt.append(time.perf_counter() - t0)
        local.finished(acme, 10)
    link = RedisLink(url, "bench")
    await link.start()
    limits = RedisTenantLimits(link)
    limits.start()
    rt = []
    for _ in range(N_CHECKS):
        t0 = time.perf_counter()
        over, _ = await limits.admit(acme)
        rt.append(time.perf_counter() - t0)
        assert over is None
        limits.finished(acme, 10)
    await limits.close()
    await link.close()
    return lt, rt


async def resumes(url: str) -> list[float]:
    settings = StreamSettings()
    a_link, b_link = RedisLink(url, "bench"), RedisLink(url, "bench")
    await a_link.start()
    await b_link.start()
    a_out, b_out = StreamReplicator(a_link, settings), StreamReplicator(b_link, settings)
    a_out.start()
    b_out.start()
    a, b = StreamStore(settings, a_out), StreamStore(settings, b_out)
    times = []
    for i in range(300):
        source = StreamSource()
        a.open(f"r{i}", "acme", source.events(), close=source.close, grace_s=10)
        for t in range(TOKENS):
            source.put(b'{"choices":[{"delta":{"content":"%d"}}]}' % t)
        await asyncio.sleep(0.002)
        await _drained(a_out)
        t0 = time.perf_counter()
        stream = await b.find(f"r{i}", "acme", after=31)
        async for item in stream.follow(31):
            assert item is not None
            break
        times.append(time.perf_counter() - t0)
        source.finish()
    for x in (a, b):
        await x.close()
    for r in (a_out, b_out):
        await r.close()
    for link in (a_link, b_link):
        await link.close()
    return times


async def main(url: str) -> None:
    print("| path | median | p90 | p99 |\n|---|---|---|---|")
    lt, rt = await checks(url)
    _row("limit check, local (check + started)", lt, 1e6, "µs")
    _row("limit check, Redis (admit: one EVALSHA)", rt, 1e6, "µs")
    r = await resumes(url)
    _row("resume on another gateway: to the first event", r)
    off, cpu_off = await http_streams(None)
    on, cpu_on = await http_streams(url)
    _row(f"streamed request, {TOKENS} tokens, HTTP: local only", off)
    _row(f"streamed request, {TOKENS} tokens, HTTP: copied to Redis", on)
    print(
        f"\nCPU per streamed HTTP request (this process: gateway + client): "
        f"{cpu_off * 1e3:.2f} ms local, {cpu_on * 1e3:.2f} ms copied"
    )
    s_off = await store_cpu(None)
    s_on = await store_cpu(url)
    print(
        f"CPU per stream of {TOKENS} events in the store: {s_off * 1e6:.0f} µs local, "
        f"{s_on * 1e6:.0f} µs copied (+{(s_on - s_off) * 1e6:.0f} µs)"
    )
    for _ in range(2):
        p_off = await store_cpu_paced(None)
        p_on = await store_cpu_paced(url)
        print(
            f"CPU per token, 32 streams at a token per 20 ms: {p_off * 1e6:.1f} µs local, "
            f"{p_on * 1e6:.1f} µs copied (+{(p_on - p_off) * 1e6:.1f} µs)"
        )


def run() -> None:
    server = shutil.which("redis-server")
    assert server, "needs redis-server"
    port = free_port()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    try:
        asyncio.run(main(f"redis://127.0.0.1:{port}/0"))
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        run()

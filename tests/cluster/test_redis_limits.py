"""Tenant limits shared through Redis (``cluster/redis_limits.py``), on a real
redis-server: one tenant's requests and tokens per minute hold across gateways (to the
request); with Redis killed, serving goes on, each gateway holds 1/N of the limits and
says so; once Redis is back (restarted empty), its windows converge on what was admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster_servers import RedisServer, needs_redis
from quantroute.cluster.redis_limits import RedisTenantLimits
from quantroute.cluster.redis_link import RedisLink, RedisTimings
from quantroute.resilience.tenants import Tenant, TenantLimits

pytestmark = needs_redis

# a loaded test machine must not read as a slow Redis, but for the fallback test
TIMINGS = RedisTimings(heartbeat_s=0.2, heartbeat_ttl_s=1.0, check_timeout_s=2.0)


@contextlib.asynccontextmanager
async def gateway(
    url: str, timings: RedisTimings = TIMINGS
) -> AsyncIterator[tuple[RedisTenantLimits, RedisLink]]:
    """One gateway's tenant limits, counted in the Redis at ``url``."""
    link = RedisLink(url, "qrtest", timings)
    await link.start()
    limits = RedisTenantLimits(link)
    limits.start()
    try:
        yield limits, link
    finally:
        await limits.close()
        await link.close()


async def _until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (what it waits for has no event)
            await asyncio.sleep(0.01)


async def _renewed(*links: RedisLink) -> None:
    for link in links:
        await link.renew()


async def test_one_tenants_requests_per_minute_hold_across_gateways(
    redis_server: RedisServer,
) -> None:
    acme = Tenant("acme", requests_per_minute=10)
    async with gateway(redis_server.url) as (a, _), gateway(redis_server.url) as (b, _):
        answers = await asyncio.gather(*(g.admit(acme) for _ in range(15) for g in (a, b)))
        admitted = [stamp for over, stamp in answers if over is None]
        refused = [over for over, _ in answers if over is not None]
        assert len(admitted) == 10  # 30 checked at once on two gateways: exactly the limit
        assert all(limit == "requests_per_minute" and 0 < s <= 60 for limit, s in refused)
        assert a.in_flight("acme") + b.in_flight("acme") == 10
        other = Tenant("other", requests_per_minute=1)  # another tenant's window is its own
        assert (await a.admit(other))[0] is None
        assert (await b.admit(other))[0] == ("requests_per_minute", pytest.approx(60, abs=1))


async def test_a_withdrawn_request_frees_its_place_on_every_gateway(
    redis_server: RedisServer,
) -> None:
    acme = Tenant("acme", requests_per_minute=2)
    async with gateway(redis_server.url) as (a, _), gateway(redis_server.url) as (b, _):
        over, first = await a.admit(acme)
        assert over is None
        assert (await b.admit(acme))[0] is None
        assert (await b.admit(acme))[0] is not None
        a.withdrawn(acme, first)  # refused by the queue: it uses none of the limit
        await _until(lambda: not a.status()["backlog"])
        assert (await b.admit(acme))[0] is None


async def test_one_tenants_tokens_per_minute_hold_across_gateways(
    redis_server: RedisServer,
) -> None:
    acme = Tenant("acme", tokens_per_minute=100, max_concurrency=8)
    async with gateway(redis_server.url) as (a, _), gateway(redis_server.url) as (b, _):
        assert (await a.admit(acme))[0] is None
        assert (await b.admit(acme))[0] is None
        a.finished(acme, 60)
        assert (await b.admit(acme))[0] is None  # 60 of 100: not yet
        b.finished(acme, 50)
        await _until(lambda: not a.status()["backlog"] and not b.status()["backlog"])
        over, _ = await a.admit(acme)
        assert over is not None and over[0] == "tokens_per_minute" and 0 < over[1] <= 61
        assert (await b.admit(acme))[0] == ("tokens_per_minute", pytest.approx(over[1], abs=1))


async def test_concurrency_stays_per_gateway(redis_server: RedisServer) -> None:
    acme = Tenant("acme", requests_per_minute=100, max_concurrency=1)
    async with gateway(redis_server.url) as (a, _), gateway(redis_server.url) as (b, _):
        both = await asyncio.gather(a.admit(acme), a.admit(acme))
        assert sorted(str(over) for over, _ in both) == ["('max_concurrency', 1.0)", "None"]
        assert (await b.admit(acme))[0] is None  # its own process, its own count
        a.finished(acme, 0)
        assert (await a.admit(acme))[0] is None


async def test_redis_killed_and_restarted(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Serving never stops: with Redis killed each check answers at once, locally, against
    1/2 of the limit (two gateways were alive), and says so (one log line per gateway, and
    ``status``); once Redis is back, empty, both windows are said again and the fleet's
    counts are what was admitted."""
    acme = Tenant("acme", requests_per_minute=10, tokens_per_minute=1000)
    fast = RedisTimings(heartbeat_s=0.2, heartbeat_ttl_s=1.0, check_timeout_s=0.5)
    async with (
        gateway(redis_server.url, fast) as (a, a_link),
        gateway(redis_server.url, fast) as (b, b_link),
    ):
        await _renewed(a_link, b_link)
        assert a_link.gateways == b_link.gateways == 2
        for _ in range(3):
            assert (await a.admit(acme))[0] is None
        a.finished(acme, 100)
        await _until(lambda: not a.status()["backlog"])
        assert a.status()["limits"] == "shared"
        redis_server.kill()
        started = time.monotonic()
        answers = [await a.admit(acme) for _ in range(4)]
        assert time.monotonic() - started < 2.0  # one timeout at most, then local at once
        # 1/2 of 10 here: A counted 3 already, so 2 more
        assert [over is None for over, _ in answers] == [True, True, False, False]
        assert answers[2][0] is not None and answers[2][0][0] == "requests_per_minute"
        assert (await b.admit(acme))[0] is None  # B's own half
        b.finished(acme, 50)
        assert a.status()["limits"] == "local: 1/2 of each per-minute limit"
        assert a.status()["local_checks"] >= 3
        assert caplog.text.count("Redis unreachable") == 2  # once per gateway
        redis_server.start()  # empty
        await _until(lambda: a_link.up and b_link.up)
        await _until(lambda: not a.status()["backlog"] and not b.status()["backlog"])
        assert a.status()["limits"] == "shared"
        counts = a_link.client
        keys = a_link.keys
        assert await counts.zcard(keys.requests("acme")) == 6  # 5 of A, 1 of B
        tokens = await counts.hgetall(keys.tokens("acme"))
        assert sum(int(v) for v in tokens.values()) == 150
        answers = [await b.admit(acme) for _ in range(5)]
        assert [over is None for over, _ in answers] == [True, True, True, True, False]


# -- end to end: two gateway processes ---------------------------------------------------

WIRED = hasattr(TenantLimits, "admit")  # api/service.py admits through the limits object


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(
    not WIRED,
    reason="needs the composition root's Redis wiring: Gateway builds RedisTenantLimits from "
    "cluster.redis_url and Service._prepare awaits limits.admit (docs/cluster.md#redis)",
)
def test_e2e_one_tenants_limit_holds_across_two_gateway_processes(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from test_redis_streams import gateway_process  # its launcher: the fleet's wiring

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text('tenants:\n  acme: {keys: ["sk-acme"], requests_per_minute: 4}\n')
    body = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    headers = {"authorization": "Bearer sk-acme"}
    with (
        gateway_process(redis_server.url, 0.0, tenants) as (a, _),
        gateway_process(redis_server.url, 0.0, tenants) as (b, _),
        ThreadPoolExecutor(6) as pool,
    ):
        bases = [a, b] * 3

        def ask(base: str) -> int:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
            return r.status_code

        codes = sorted(pool.map(ask, bases))
    assert codes == [200, 200, 200, 200, 429, 429]  # 6 at once on two gateways: exactly 4

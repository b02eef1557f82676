"""Tenant limits that hold across the fleet: each tenant's requests and tokens per minute
are counted in Redis, so N gateways together admit what one would.

:class:`RedisTenantLimits` has the interface of
:class:`~quantroute.resilience.tenants.TenantLimits` (``check``, ``started``,
``withdrawn``, ``finished``, ``in_flight``) and one more, :meth:`~RedisTenantLimits.admit`:
the check and the count of one request in one step, one round trip to Redis (an
``EVALSHA`` of one Lua script, atomic: requests checked at once on any gateways cannot
pass a limit together). Its answer comes within ``check_timeout_s`` (50 ms) or the local
fallback answers instead.

Keys, for a tenant ``T`` under the prefix ``P`` (``cluster.name``):

- ``P:limits:{T}:requests``: a sorted set of the requests of the last minute, each
  ``<gateway id>:<stamp>`` scored by its start (Redis time, ms); a sliding window, exact
  to the request. It expires a minute after the last.
- ``P:limits:{T}:tokens``: a hash of the tokens of the requests that ended, per second
  (field: Redis time in s); the sum of the last 60 whole seconds is the minute's.

``requests_per_minute`` is checked and counted at admission; ``tokens_per_minute`` is
checked at admission and counted when a request ends (as ``TenantLimits`` does, so
requests in flight can pass it together). ``max_concurrency`` stays per gateway (a count
of what runs in this process: one that died would hold its count in Redis).

Redis down, or slower than ``check_timeout_s``: every gateway falls back to its own
counts and 1/N of each per-minute limit, N the gateways alive at its last renewal
(``cluster/redis_link.py``); it logs that once, and :meth:`~RedisTenantLimits.status`
says so. Counts made meanwhile (requests admitted locally, tokens, withdrawals) wait in
a bounded backlog and are sent once Redis answers; a Redis that came back empty (a
restart) is sent every count of the last minute again (each gateway keeps its own). So
the windows converge on what the fleet really admitted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import replace
from typing import Any

from quantroute.cluster.redis_link import FAILURES, RedisLink
from quantroute.resilience.tenants import WINDOW_S, Tenant, TenantLimits
from quantroute.tasks import cancel_and_wait

__all__ = ["RedisTenantLimits"]

log = logging.getLogger(__name__)

MAX_BACKLOG = 10_000  # counts waiting for Redis at most; past it the oldest are lost
MAX_JOURNAL = 100_000  # counts of the last minute kept to say again (a Redis restart)

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local horizon = now - window
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {1, tonumber(oldest[2]) + window - now, now}
  end
end
if tpm > 0 then
  local sum, oldest = 0, nil
  local fields = redis.call('HGETALL', KEYS[2])
  for i = 1, #fields, 2 do
    local second = tonumber(fields[i])
    if (second + 1) * 1000 <= horizon then
      redis.call('HDEL', KEYS[2], fields[i])
    else
      sum = sum + tonumber(fields[i + 1])
      if oldest == nil or second < oldest then oldest = second end
    end
  end
  if sum >= tpm then
    return {2, (oldest + 1) * 1000 + window - now, now}
  end
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
end
return {0, 0, now}
"""

# The backlog: per key, 3 arguments (after the window, ms): ``r`` member ms (a request),
# ``w`` member - (withdrawn), ``t`` second tokens (tokens of requests that ended).
_COUNTS = """
local window = tonumber(ARGV[1])
local a = 2
for i = 1, #KEYS do
  local what = ARGV[a]
  if what == 'r' then
    redis.call('ZADD', KEYS[i], ARGV[a + 2], ARGV[a + 1])
    redis.call('PEXPIRE', KEYS[i], window)
  elseif what == 'w' then
    redis.call('ZREM', KEYS[i], ARGV[a + 1])
  else
    redis.call('HINCRBY', KEYS[i], ARGV[a + 1], ARGV[a + 2])
    redis.call('PEXPIRE', KEYS[i], window + 1000)
  end
  a = a + 3
end
return 0
"""

_OVER = {1: "requests_per_minute", 2: "tokens_per_minute"}

# a count that waits for Redis: (what, tenant, monotonic time, tokens / request stamp)
_REQUEST, _WITHDRAWN, _TOKENS = 0, 1, 2
_Count = tuple[int, str, float, float]


class RedisTenantLimits:
    """Per-tenant limits over a sliding minute, shared by the fleet through Redis; see the
    module docstring. ``start`` and ``close`` run its background sender."""

    def __init__(
        self, link: RedisLink, local: TenantLimits | None = None, window_s: float = WINDOW_S
    ):
        self._link = link
        self._local = local or TenantLimits(window_s)
        self._window_s = window_s
        self._window_ms = int(window_s * 1000)
        self._script = link.client.register_script(_ADMIT)
        self._counts = link.client.register_script(_COUNTS)
        self._backlog: deque[_Count] = deque()
        self._journal: deque[_Count] = deque(maxlen=MAX_JOURNAL)  # every count, a minute
        self._scaled: dict[tuple[Tenant, int], Tenant] = {}
        self._last_stamp = 0.0
        self._sending = 0  # the oldest counts of the backlog, in a pipeline now
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.local_checks = 0  # checks the local fallback answered
        self.lost = 0  # counts that never reached Redis (the backlog's bound)
        link.on_up(self._wake.set)
        link.on_reset(self._said_again)

    # -- TenantLimits's interface ------------------------------------------------------

    def in_flight(self, name: str) -> int:
        """Requests of the tenant ``name`` in flight on this gateway."""
        return self._local.in_flight(name)

    def check(self, tenant: Tenant, now: float | None = None) -> tuple[str, float] | None:
        """The local answer: this gateway's own counts against 1/N of each per-minute
        limit (N: the gateways last seen). :meth:`admit` asks the fleet's."""
        return self._local.check(self._share(tenant), now)

    def started(self, tenant: Tenant, now: float | None = None) -> float:
        """Count one request here from now on, and in the fleet's window once Redis takes it."""
        stamp = self._local.started(tenant, self._stamp(now))
        if tenant.requests_per_minute is not None:
            self._count((_REQUEST, tenant.name, stamp, stamp))
        return stamp

    def withdrawn(self, tenant: Tenant, stamp: float) -> None:
        self._local.withdrawn(tenant, stamp)
        if tenant.requests_per_minute is not None:
            self._count((_WITHDRAWN, tenant.name, stamp, stamp))

    def finished(self, tenant: Tenant, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._local.finished(tenant, tokens, now)
        if tokens > 0 and tenant.tokens_per_minute is not None:
            self._count((_TOKENS, tenant.name, now, float(tokens)))

    # -- the fleet's answer ------------------------------------------------------------

    async def admit(self, tenant: Tenant) -> tuple[tuple[str, float] | None, float]:
        """:meth:`check` and :meth:`started` in one step, against the fleet's counts:
        ``(None, stamp)`` when the request is counted (``stamp`` for :meth:`withdrawn`),
        ``((which limit, retry after s), 0.0)`` when it is over one."""
        link = self._link
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        if (rpm is None and tpm is None) or not link.up:
            return self._admit_here(tenant)
        local = self._local
        ceiling = tenant.max_concurrency
        if ceiling is not None and local.in_flight(tenant.name) >= ceiling:
            return ("max_concurrency", 1.0), 0.0
        stamp = local.started(tenant, self._stamp(None))  # in flight now: the others see it
        keys = [link.keys.requests(tenant.name), link.keys.tokens(tenant.name)]
        member = self._member(stamp)
        try:
            async with asyncio.timeout(link.timings.check_timeout_s):
                code, value, _ = await self._script(
                    keys, [rpm or 0, tpm or 0, member, self._window_ms]
                )
        except FAILURES as exc:
            local.withdrawn(tenant, stamp)
            link.failed(exc, "limit check")
            return self._admit_here(tenant)
        except asyncio.CancelledError:  # its client left: it may have been counted there
            self.withdrawn(tenant, stamp)
            raise
        if int(code) == 0:
            if rpm is not None:
                self._journal.append((_REQUEST, tenant.name, stamp, stamp))
            return None, stamp
        local.withdrawn(tenant, stamp)
        return (_OVER[int(code)], max(0.0, int(value) / 1000)), 0.0

    def _admit_here(self, tenant: Tenant) -> tuple[tuple[str, float] | None, float]:
        if tenant.requests_per_minute is not None or tenant.tokens_per_minute is not None:
            self.local_checks += 1
        over = self.check(tenant)
        if over is not None:
            return over, 0.0
        return None, self.started(tenant)

    def _share(self, tenant: Tenant) -> Tenant:
        """``tenant`` with 1/N of each per-minute limit (at least 1), N the gateways."""
        n = self._link.gateways
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        if n <= 1 or (rpm is None and tpm is None):
            return tenant
        shared = self._scaled.get((tenant, n))
        if shared is None:
            if len(self._scaled) > 4096:  # tenants' limits changed many times: start over
                self._scaled.clear()
            shared = self._scaled[(tenant, n)] = replace(
                tenant,
                requests_per_minute=None if rpm is None else max(1, rpm // n),
                tokens_per_minute=None if tpm is None else max(1, tpm // n),
            )
        return shared

    def _stamp(self, now: float | None) -> float:
        """A monotonic time no earlier request of this gateway has: it names the request."""
        now = time.monotonic() if now is None else now
        if now <= self._last_stamp:
            now = math.nextafter(self._last_stamp, math.inf)
        self._last_stamp = now
        return now

    def _member(self, stamp: float) -> str:
        return f"{self._link.gateway}:{stamp!r}"

    def status(self) -> dict[str, Any]:
        """What ``/admin/status`` may show: whose counts the limits hold to now."""
        up, n = self._link.up, self._link.gateways
        return {
            "limits": "shared" if up else f"local: 1/{n} of each per-minute limit",
            "gateways": n,
            "local_checks": self.local_checks,
            "backlog": len(self._backlog),
            "lost_counts": self.lost,
        }

    # -- counts sent in the background -------------------------------------------------

    def _said_again(self) -> None:
        """Redis lost its counts: every one of the last minute goes again (the backlog's
        are among them)."""
        horizon = time.monotonic() - self._window_s
        journal = self._journal
        while journal and journal[0][2] <= horizon:
            journal.popleft()
        self._backlog = deque(journal)
        self._sending = 0
        while len(self._backlog) > MAX_BACKLOG:
            self._backlog.popleft()
            self.lost += 1
        self._wake.set()

    def _count(self, count: _Count) -> None:
        journal = self._journal
        journal.append(count)
        horizon = count[2] - self._window_s
        while journal[0][2] <= horizon:
            journal.popleft()
        backlog = self._backlog
        if len(backlog) >= MAX_BACKLOG:
            backlog.popleft()
            self.lost += 1
            self._sending = max(0, self._sending - 1)
        backlog.append(count)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-limits")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._backlog and self._link.up:
            await self._send()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._link.timings.flush_s)
            self._wake.clear()
            if self._backlog and self._link.up:
                await self._send()

    async def _send(self) -> None:
        """Send the backlog in one script call; kept for the next try if Redis fails."""
        link = self._link
        counts = list(self._backlog)
        horizon = time.monotonic() - self._window_s
        keys: list[str] = []
        args: list[str | int] = [self._window_ms]
        for what, name, at, value in counts:
            if at <= horizon:
                continue  # out of every window already
            if what == _TOKENS:
                keys.append(link.keys.tokens(name))
                args += ("t", link.redis_ms(at) // 1000, int(value))
            else:
                keys.append(link.keys.requests(name))
                args += ("r" if what == _REQUEST else "w", self._member(value), link.redis_ms(at))
        self._sending = len(counts)
        try:
            async with asyncio.timeout(link.timings.command_timeout_s):
                if keys:
                    await self._counts(keys, args)
        except FAILURES as exc:
            link.failed(exc, "limit counts")
            return
        finally:
            sent, self._sending = self._sending, 0
        for _ in range(sent):
            self._backlog.popleft()

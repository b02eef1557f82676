"""One gateway's link to the fleet's Redis: the client, the key names, and its presence.

Every gateway of a fleet (``cluster.redis_url``, keys under ``cluster.name``) registers
itself and renews that every ``heartbeat_s`` (:class:`RedisLink`'s own task, one Lua
script, one round trip): a key of its own that expires ``heartbeat_ttl_s`` after its last
renewal (a stream's readers on other gateways learn from it that the stream's producer is
gone) and its id in a sorted set scored by the last time it was seen (the gateways alive
now: the local limits are scaled by their number while Redis is down). The renewal is
also the probe that says whether Redis answers: :attr:`RedisLink.up` is false from the
first failure anywhere (a write, a check, a renewal) until a renewal answers again, and
the request path does not wait on Redis while it is false. Going down is logged once,
and coming back once. A Redis that came back empty (restarted without its data: the
epoch key, set once by the first renewal, has another value) is told to the parts that
can say again what they had (:meth:`RedisLink.on_reset`).

Keys (``P`` is ``cluster.name``): ``P:gateways`` (sorted set: gateway id -> Redis time of
its last renewal, ms; expires 4 heartbeat TTLs after the last), ``P:gateway:<id>`` (its
heartbeat, ``heartbeat_ttl_s``), ``P:epoch`` (a random value the first renewal sets).
The streams' and the limits' keys: ``cluster/redis_streams.py``,
``cluster/redis_limits.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from quantroute.tasks import cancel_and_wait

__all__ = ["FAILURES", "RedisKeys", "RedisLink", "RedisTimings"]

log = logging.getLogger(__name__)

# What a Redis command can fail with: Redis's own errors, a socket's, our own time limit.
FAILURES = (RedisError, OSError, TimeoutError)

_PRESENCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[2], '1', 'PX', ttl)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl * 4)
redis.call('SET', KEYS[3], ARGV[3], 'NX')
return {redis.call('ZCARD', KEYS[1]), now, redis.call('GET', KEYS[3])}
"""

_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class RedisTimings:
    """How long a gateway waits on Redis, and how often it renews its presence."""

    command_timeout_s: float = 0.5  # a background write (a batch of stream events, counts)
    check_timeout_s: float = 0.05  # a limit check; past it the local fallback answers
    connect_timeout_s: float = 0.5
    heartbeat_s: float = 1.0  # presence renewal, and the probe while Redis is down
    heartbeat_ttl_s: float = 5.0  # a gateway not renewed for this long is gone
    flush_s: float = 0.05  # background writes wait this long to gather a batch
    read_block_s: float = 1.0  # a remote reader's wait for more, between liveness looks


class RedisKeys:
    """The names of the fleet's keys, all under one prefix (``cluster.name``).

    A key pair read together (a stream and its meta, a tenant's two windows) shares a
    ``{hash tag}``; ``:`` separates the parts. Names are Redis binary-safe strings.

    >>> RedisKeys("qr").stream("job-1"), RedisKeys("qr").requests("acme")
    ('qr:stream:{job-1}', 'qr:limits:{acme}:requests')
    """

    __slots__ = ("prefix",)

    def __init__(self, prefix: str):
        self.prefix = prefix

    @property
    def gateways(self) -> str:
        return f"{self.prefix}:gateways"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    def alive(self, gateway: str) -> str:
        return f"{self.prefix}:gateway:{gateway}"

    def stream(self, key: str) -> str:
        return f"{self.prefix}:stream:{{{key}}}"

    def stream_meta(self, key: str) -> str:
        return f"{self.prefix}:stream:{{{key}}}:meta"

    def requests(self, tenant: str) -> str:
        return f"{self.prefix}:limits:{{{tenant}}}:requests"

    def tokens(self, tenant: str) -> str:
        return f"{self.prefix}:limits:{{{tenant}}}:tokens"


def _gateway_id() -> str:
    """This process's id in the fleet: readable, and unique across restarts."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"


def _client(url: str, socket_timeout_s: float, connect_timeout_s: float) -> Redis:
    # no retries inside redis-py: a failure is answered at once (the local fallback), and
    # the heartbeat is what tries again
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RedisLink:
    """A gateway's clients of the fleet's Redis, its keys, its id and its presence;
    ``start`` registers it and keeps it registered, ``close`` leaves and closes.

    ``client`` takes every short command; ``reader`` the blocking reads of remote streams
    (a connection each while it waits, and a longer socket timeout)."""

    def __init__(
        self,
        url: str,
        name: str = "quantroute",
        timings: RedisTimings | None = None,
        gateway: str | None = None,
    ):
        self.timings = t = timings or RedisTimings()
        self.keys = RedisKeys(name)
        self.gateway = gateway or _gateway_id()
        self.client = _client(url, t.command_timeout_s, t.connect_timeout_s)
        self.reader = _client(url, t.read_block_s + t.command_timeout_s, t.connect_timeout_s)
        self._presence = self.client.register_script(_PRESENCE)
        self._leave = self.client.register_script(_LEAVE)
        self.up = False  # Redis answered the last time we asked
        self.down_since: float | None = time.monotonic()  # monotonic; None while up
        self.gateways = 1  # gateways alive at the last renewal (this one included)
        self.failures = 0  # operations that failed, since start
        self._clock_ms = 0.0  # Redis time (ms) minus monotonic time (ms), at the last renewal
        self._on_up: list[Callable[[], None]] = []
        self._on_reset: list[Callable[[], None]] = []
        self._epoch: bytes | None = None  # Redis's, as first seen
        self._task: asyncio.Task[None] | None = None
        self._logged_down = False

    # -- state ---------------------------------------------------------------------

    def on_up(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time Redis answers again after a failure."""
        self._on_up.append(callback)

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when Redis answers having lost what it held (a restart)."""
        self._on_reset.append(callback)

    def failed(self, exc: BaseException, what: str) -> None:
        """An operation on Redis failed: Redis counts as down until a renewal answers."""
        self.failures += 1
        if self.up or not self._logged_down:
            self._logged_down = True
            log.warning(
                "Redis unreachable (%s: %s): streams are served by their own gateway only, "
                "and each tenant limit is held locally at 1/%d (gateways last seen)",
                what,
                type(exc).__name__,
                self.gateways,
            )
        if self.up:
            self.up = False
            self.down_since = time.monotonic()

    def _answered(self, gateways: int, redis_ms: float, epoch: bytes) -> None:
        self.gateways = max(1, gateways)
        self._clock_ms = redis_ms - time.monotonic() * 1000
        was, self._epoch = self._epoch, epoch
        if was is not None and was != epoch:
            log.warning("Redis lost what it held (a restart): saying it again")
            for callback in self._on_reset:
                callback()
        if self.up:
            return
        self.up = True
        if self._logged_down and self.down_since is not None:
            log.warning(
                "Redis reachable again after %.1f s: streams and limits are shared again",
                time.monotonic() - self.down_since,
            )
        self._logged_down = False
        self.down_since = None
        for callback in self._on_up:
            callback()

    def redis_ms(self, monotonic_s: float) -> int:
        """Redis's clock (ms) at the local monotonic time ``monotonic_s``, as last measured."""
        return int(monotonic_s * 1000 + self._clock_ms)

    def status(self) -> dict[str, Any]:
        """What ``/admin/status`` may show of the link."""
        down = self.down_since
        return {
            "redis": "up" if self.up else "down",
            "down_for_s": None if down is None else round(time.monotonic() - down, 1),
            "gateway": self.gateway,
            "gateways": self.gateways,
            "failures": self.failures,
        }

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Register (once, now: it does not wait past its time limit) and keep renewing."""
        await self.renew()
        self._task = asyncio.get_running_loop().create_task(self._beat(), name="redis-presence")

    async def renew(self) -> bool:
        """Renew this gateway's presence once; whether Redis answered."""
        t = self.timings
        keys = [self.keys.gateways, self.keys.alive(self.gateway), self.keys.epoch]
        ttl_ms = int(t.heartbeat_ttl_s * 1000)
        try:
            async with asyncio.timeout(t.command_timeout_s + t.connect_timeout_s):
                count, now, epoch = await self._presence(
                    keys, [self.gateway, ttl_ms, secrets.token_hex(8)]
                )
        except FAILURES as exc:
            self.failed(exc, "presence")
            return False
        self._answered(int(count), float(now), bytes(epoch))
        return True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.timings.heartbeat_s)
            await self.renew()

    async def close(self) -> None:
        """Leave the fleet (readers of this gateway's streams learn it at once) and close."""
        await cancel_and_wait(self._task)
        self._task = None
        if self.up:
            with contextlib.suppress(*FAILURES):
                async with asyncio.timeout(self.timings.command_timeout_s):
                    await self._leave(
                        [self.keys.gateways, self.keys.alive(self.gateway)], [self.gateway]
                    )
        await self.client.aclose()
        await self.reader.aclose()

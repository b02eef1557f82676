"""A gateway's part in the fleet's Redis (``cluster.redis_url``): its link (presence and
clients, ``redis_link.py``), the tenants' limits shared over the fleet
(``redis_limits.py``) and the copies of its streams (``redis_streams.py``), started and
stopped together and reported as one ``redis`` status. The composition root builds one
when the URL is set (``RedisFleet.of``), else keeps limits and streams in process."""

from __future__ import annotations

from typing import Any

from quantroute.cluster.redis_limits import RedisTenantLimits
from quantroute.cluster.redis_link import RedisLink
from quantroute.cluster.redis_streams import StreamReplicator
from quantroute.config import Settings

__all__ = ["RedisFleet"]


class RedisFleet:
    """The link, the shared limits and the stream copies of one gateway."""

    def __init__(self, link: RedisLink, settings: Settings):
        self.link = link
        self.limits = RedisTenantLimits(link)
        self.copies = StreamReplicator(link, settings.streams)

    @classmethod
    def of(cls, settings: Settings) -> RedisFleet | None:
        """The fleet's Redis as the settings name it; ``None`` without ``cluster.redis_url``."""
        c = settings.cluster
        if c.redis_url is None:
            return None
        return cls(RedisLink(c.redis_url.get_secret_value(), c.name), settings)

    async def start(self) -> None:
        """Register this gateway (never raises; waits at most a second if Redis is down),
        then send counts and copies in the background."""
        await self.link.start()
        self.limits.start()
        self.copies.start()

    async def stop(self) -> None:
        """After the stream store closed: send the ends of its streams and the counts still
        waiting, then leave the fleet (readers elsewhere learn it)."""
        await self.copies.close()
        await self.limits.close()
        await self.link.close()

    def status(self) -> dict[str, Any]:
        """``/admin/status``'s ``redis``: up or down, the gateways seen, how limits are
        checked, what the copies hold and dropped."""
        return self.link.status() | self.limits.status() | self.copies.status()

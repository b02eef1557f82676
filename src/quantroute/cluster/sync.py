"""Keeping a gateway's cluster state in step with etcd: read everything, then watch.

One loop per gateway, a background task its lifespan owns (``ClusterState.start``)::

    read every key under the prefix (one range: the keys and revision R)
      → the state replaces its keys with them           (one swap per part)
      → watch the prefix from R + 1                      (each message: one swap per part)
         while a probe every etcd_probe_interval_s says etcd still answers
    on a compacted revision: read everything again at once
    on etcd unreachable: the state says degraded (and serves on with what it has);
      try again after 0.1 s, doubling up to etcd_retry_max_s

A watch on a connection that died quietly (a partition, a host gone) says nothing, so
the probe is what notices; a watch on one whose server closed it fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from quantroute.cluster.etcd import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    Snapshot,
    WatchBatch,
)

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.1


class Synced(Protocol):
    """What the loop tells the state it keeps (``ClusterState``)."""

    def synced(self, snapshot: Snapshot) -> None:
        """Every key as of ``snapshot.revision``: replace what was known."""

    def changed(self, batch: WatchBatch) -> None:
        """The events of one watch message, in order."""

    def lost(self, why: str) -> None:
        """etcd cannot be read now: serve on with what is known, and say so."""


async def keep_in_sync(
    client: EtcdClient,
    state: Synced,
    prefix: str,
    *,
    probe_interval_s: float,
    retry_max_s: float,
    watch_from: int | None = None,
) -> None:
    """Run until cancelled. ``watch_from``: the revision after a read already made
    (the first read at start), to watch from without reading again."""
    delay = FIRST_RETRY_S
    while True:
        try:
            if watch_from is None:
                snapshot = await client.range_prefix(prefix)
                state.synced(snapshot)
                watch_from = snapshot.revision + 1
            delay = FIRST_RETRY_S
            await _watch(client, state, prefix, watch_from, probe_interval_s)
        except EtcdCompacted as exc:
            log.warning("cluster: %s; reading every key again", exc)
        except EtcdError as exc:
            state.lost(str(exc))
            await asyncio.sleep(delay)
            delay = min(2 * delay, retry_max_s)
        watch_from = None  # whatever ended the watch, the next one starts from a fresh read


async def _watch(
    client: EtcdClient, state: Synced, prefix: str, start: int, probe_interval_s: float
) -> None:
    """Apply the watch's messages until it or the probe fails; raises what failed."""
    follow = asyncio.create_task(_follow(client, state, prefix, start), name="etcd watch")
    probe = asyncio.create_task(_probe(client, probe_interval_s), name="etcd probe")
    try:
        done, _ = await asyncio.wait({follow, probe}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        follow.cancel()
        probe.cancel()
        await asyncio.gather(follow, probe, return_exceptions=True)
    for task in done:
        task.result()  # the failure that ended it
    raise EtcdError("the watch ended")  # neither ends without one


async def _follow(client: EtcdClient, state: Synced, prefix: str, start: int) -> None:
    async with contextlib.aclosing(client.watch(prefix, start)) as batches:
        async for batch in batches:
            state.changed(batch)


async def _probe(client: EtcdClient, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await client.revision()

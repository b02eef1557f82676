"""What a fleet of gateways shares: operator state in etcd (this package's ``etcd.py``,
``records.py``, ``sync.py``, ``state.py``); streams and rate-limit windows in Redis
(``redis_*.py``). Without ``cluster.*`` settings every gateway keeps it all in process.

Modules, leaf first: ``etcd`` (the client: etcd's JSON gateway over httpx),
``records`` (the key layout and the JSON values, read into a ``ClusterView``),
``sync`` (read everything, then watch; resynchronise after a failure), ``state``
(``ClusterState``: applies the view to the gateway's parts, drains, status).
"""

from __future__ import annotations

from quantroute.cluster.etcd import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    Event,
    KeyValue,
    Snapshot,
    WatchBatch,
)
from quantroute.cluster.records import ClusterView, Layout, Traffic, read_view
from quantroute.cluster.state import ClusterState
from quantroute.cluster.sync import keep_in_sync

__all__ = [
    "ClusterState",
    "ClusterView",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "KeyValue",
    "Layout",
    "Snapshot",
    "Traffic",
    "WatchBatch",
    "keep_in_sync",
    "read_view",
]

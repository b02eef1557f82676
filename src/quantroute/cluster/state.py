"""The fleet's operator state in one gateway, and how it is applied to the gateway's parts.

:class:`ClusterState` keeps the keys under ``/<cluster.name>/`` (from etcd, or, without
etcd, written by this gateway alone), reads them into one
:class:`~quantroute.cluster.records.ClusterView`, and applies what changed, each part
in one assignment, as a reload swaps its table:

==================  =============================================================
part                what a change does
==================  =============================================================
drains              ``Residency.set_drained``: the set of drained branch ids
traffic rules       ``RouteTableRef.current``: the table with the model's
                    ``VersionSplit`` replaced (:meth:`ClusterState.overlay`)
tenants             ``Tenants.replace``: every key digest and its tenant
==================  =============================================================

A reload builds its table from the repository; the gateway passes it through
:meth:`overlay` before serving it, so etcd's rules outlive reloads. Without etcd a
drain is this gateway's alone; with etcd it is written there first and is in force
here when the call returns (the watch then brings it to every gateway).

etcd unreachable: the gateway serves on with the last state it read, says
``degraded`` (and since when) in ``/admin/status``, and reads everything again when
etcd answers (``cluster/sync.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quantroute.cluster.etcd import EtcdClient, EtcdError, Snapshot, WatchBatch
from quantroute.cluster.records import ClusterView, Layout, read_view
from quantroute.cluster.sync import keep_in_sync
from quantroute.config import ClusterSettings
from quantroute.errors import ServiceUnavailableError
from quantroute.resilience.tenants import Tenants
from quantroute.routing.table import RouteTable, RouteTableRef
from quantroute.routing.versions import VersionSplit
from quantroute.tasks import cancel_and_wait

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # a write refused while etcd is unreachable


class ClusterState:
    """The drains, traffic rules and tenants this gateway serves with, kept in step with
    etcd when ``client`` is given (else kept here alone)."""

    def __init__(
        self,
        settings: ClusterSettings,
        routes: RouteTableRef,
        set_drained: Callable[[frozenset[str]], None],
        tenants: Tenants,
        *,
        client: EtcdClient | None = None,
    ):
        """``client``: for tests; else one for ``settings.etcd_endpoints`` (if any) is made
        at :meth:`start`."""
        self.layout = Layout(settings.name)
        self._settings = settings
        self._client = client
        self._routes = routes
        self._set_drained = set_drained
        self._tenants = tenants
        self._file_tenants = tenants.entries()  # what serves while etcd holds no tenant
        self._items: dict[str, bytes] = {}  # key -> value, every key under the prefix
        self._revisions: dict[str, int] = {}  # key -> the revision of its last write/delete
        self._bases: dict[str, tuple[VersionSplit, VersionSplit]] = {}  # served, manifest's
        self._traffic_problems: dict[str, str] = {}
        self.view = ClusterView()
        self.revision = 0  # the store's revision this state is as of
        self.changes_applied = 0
        etcd = client is not None or bool(settings.etcd_endpoints)
        self.store = "etcd" if etcd else "local"
        self.connected = not etcd
        self.degraded_since: float | None = time.time() if etcd else None
        self.last_error: str | None = "not read yet" if etcd else None
        self.synced_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (the gateway's start and stop) ----------------------------------

    async def start(self) -> None:
        """Read etcd once (so that the first request sees the fleet's state), then keep
        watching in the background. An etcd that does not answer is no reason not to
        serve: the gateway starts with its own configuration, degraded."""
        s = self._settings
        if self.store == "local":
            return
        if self._client is None:
            self._client = EtcdClient(s.etcd_endpoints, timeout_s=s.etcd_timeout_s)
        client = self._client
        watch_from = None
        try:
            snapshot = await client.range_prefix(self.layout.prefix)
        except EtcdError as exc:
            self.lost(str(exc))
            log.error(
                "cluster: etcd (%s) cannot be read at start: %s; serving this gateway's own "
                "configuration until it can",
                ", ".join(client.endpoints),
                exc,
            )
        else:
            self.synced(snapshot)
            watch_from = snapshot.revision + 1
        self._task = asyncio.get_running_loop().create_task(
            keep_in_sync(
                client,
                self,
                self.layout.prefix,
                probe_interval_s=s.etcd_probe_interval_s,
                retry_max_s=s.etcd_retry_max_s,
                watch_from=watch_from,
            ),
            name="cluster sync",
        )

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- what the sync loop tells (cluster.sync.Synced) ------------------------------

    def synced(self, snapshot: Snapshot) -> None:
        """Every key as of ``snapshot.revision``; this gateway's writes newer than the
        read stand (the watch brings them again)."""
        if snapshot.revision < self.revision:  # a new etcd (its data lost): start over
            log.warning("cluster: etcd's revision went back to %d", snapshot.revision)
            self._revisions = {}
        items = {kv.key: kv.value for kv in snapshot.items}
        revisions = {kv.key: kv.mod_revision for kv in snapshot.items}
        for key, revision in self._revisions.items():
            if revision > snapshot.revision:  # written here after the read was made
                revisions[key] = revision
                if key in self._items:
                    items[key] = self._items[key]
                else:
                    items.pop(key, None)
        self._items, self._revisions = items, revisions
        self.revision = snapshot.revision
        if self.synced_at is None:
            log.info("cluster: read etcd's state at revision %d", snapshot.revision)
        elif not self.connected:
            log.warning("cluster: etcd is back (revision %d)", snapshot.revision)
        self.synced_at = time.time()
        self.connected, self.degraded_since, self.last_error = True, None, None
        self._apply()

    def changed(self, batch: WatchBatch) -> None:
        """One watch message, applied at once."""
        for event in batch.events:
            self._write(event.key, event.value, event.mod_revision)
        self.revision = max(self.revision, batch.revision)
        self._apply()

    def lost(self, why: str) -> None:
        if self.connected:
            log.error("cluster: etcd unreachable (%s); serving with the last state read", why)
        self.connected = False
        self.last_error = why
        if self.degraded_since is None:
            self.degraded_since = time.time()

    # -- operator actions --------------------------------------------------------

    def drained(self, branch_id: str) -> bool:
        return branch_id in self.view.drained

    async def drain(self, branch_id: str, reason: str | None = None) -> int:
        """Drain ``branch_id`` on every gateway; the revision of the write."""
        record: dict[str, Any] = {"state": "drained", "at": round(time.time(), 3)}
        if reason:
            record["reason"] = reason
        return await self._put(self.layout.branch_admin(branch_id), record)

    async def undrain(self, branch_id: str) -> int:
        """Let ``branch_id`` take requests again on every gateway."""
        return await self._put(self.layout.branch_admin(branch_id), None)

    async def _put(self, key: str, record: dict[str, Any] | None) -> int:
        """Write (``None``: delete) ``key`` in etcd, then here: in force when it returns."""
        value = None if record is None else json.dumps(record, sort_keys=True).encode()
        client = self._client
        if self.store == "local":
            revision = self.revision + 1
            self.revision = revision
        elif client is None:  # not started, or stopped
            raise ServiceUnavailableError("the cluster state is not started")
        else:
            try:
                if value is None:
                    revision = await client.delete(key)
                else:
                    revision = await client.put(key, value)
            except EtcdError as exc:
                raise ServiceUnavailableError(
                    "the cluster's state store (etcd) did not take the change; nothing "
                    "changed: try again",
                    retry_after_s=RETRY_AFTER_S,
                ) from exc
        self._write(key, value, revision)
        self._apply()
        return revision

    # -- applying ------------------------------------------------------------------

    def _write(self, key: str, value: bytes | None, revision: int) -> None:
        """One key written (``None``: deleted) at ``revision``, unless a later write of it
        is known (this gateway's own, ahead of the watch)."""
        if revision < self._revisions.get(key, 0):
            return
        self._revisions[key] = revision
        if value is None:
            self._items.pop(key, None)
        else:
            self._items[key] = value

    def _apply(self) -> None:
        """Read the keys into a view and hand each part what changed, whole."""
        view = read_view(self.layout, self._items)
        old, self.view = self.view, view
        changed = False
        if view.drained.keys() != old.drained.keys():
            self._set_drained(frozenset(view.drained))
            changed = True
        if view.traffic != old.traffic:
            table = self._routes.current
            served = self.overlay(table)
            if served is not table:
                self._routes.current = served  # one reference: old rules or new
            changed = True
        if (view.tenants, view.tenant_names) != (old.tenants, old.tenant_names):
            self._tenants.replace(view.tenants if view.tenant_names else self._file_tenants)
            changed = True
        for key in view.problems.keys() - old.problems.keys():
            log.error("cluster: %s is refused: %s", key, view.problems[key])
        if changed:
            self.changes_applied += 1
            log.info(
                "cluster: applied revision %d (drained: %s)",
                self.revision,
                ", ".join(sorted(view.drained)) or "none",
            )

    def overlay(self, table: RouteTable) -> RouteTable:
        """``table`` with etcd's traffic rules in place of its manifests': the table to
        serve. A split this state put in a table earlier stands for the manifest's it
        replaced (a reload keeps a failed model's split from the table it replaces)."""
        splits: dict[str, VersionSplit] = {}
        bases: dict[str, tuple[VersionSplit, VersionSplit]] = {}
        problems: dict[str, str] = {}
        for model, split in table.splits.items():
            served, base = self._bases.get(model, (None, split))
            if split is not served:
                base = split  # a table from the repository: its own rules are the base
            new = base
            traffic = self.view.traffic.get(model)
            if traffic is not None:
                try:
                    new = traffic.split(base)
                except ValueError as exc:
                    problems[self.layout.traffic(model)] = str(exc)
            if new == split:
                new = split
            splits[model] = new
            bases[model] = (new, base)
        for model in self.view.traffic.keys() - table.splits.keys():
            if model in table.models:
                problems[self.layout.traffic(model)] = f"{model} has no versions"
        for key in problems.keys() - self._traffic_problems.keys():
            log.error("cluster: %s is refused: %s", key, problems[key])
        self._bases, self._traffic_problems = bases, problems
        if all(splits[m] is s for m, s in table.splits.items()):
            return table
        return replace(table, splits=MappingProxyType(splits))

    # -- views -------------------------------------------------------------------

    def status_json(self) -> dict[str, Any]:
        """``/admin/status``'s ``cluster`` section."""
        view = self.view
        now = time.time()
        since = self.degraded_since
        tenant_source = "etcd" if view.tenant_names else "file" if self._file_tenants else "none"
        return {
            "store": self.store,
            "name": self._settings.name,
            "endpoints": list(self._settings.etcd_endpoints),
            "state": "local"
            if self.store == "local"
            else ("connected" if self.connected else "degraded"),
            "degraded": not self.connected,
            "degraded_since": since,
            "degraded_for_s": None if since is None else round(now - since, 3),
            "last_error": self.last_error,
            "revision": self.revision,
            "synced_at": self.synced_at,
            "changes_applied": self.changes_applied,
            "drained": dict(view.drained),
            "traffic": {m: t.to_json() for m, t in sorted(view.traffic.items())},
            "tenants": {"source": tenant_source, "names": sorted(view.tenant_names)},
            "problems": {**view.problems, **self._traffic_problems},
        }

    def metrics_text(self) -> bytes:
        """The cluster's Prometheus families (see :class:`_Collector`)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector(Collector):
    """``quantroute_cluster_etcd_connected`` (with etcd only) and
    ``quantroute_cluster_changes_applied_total``."""

    def __init__(self, state: ClusterState):
        self._state = state

    def collect(self) -> Iterable[Metric]:
        state = self._state
        if state.store == "etcd":
            yield GaugeMetricFamily(
                "quantroute_cluster_etcd_connected",
                "1 while this gateway reads etcd; 0 while it serves with the last state read.",
                value=1.0 if state.connected else 0.0,
            )
        yield CounterMetricFamily(
            "quantroute_cluster_changes_applied_total",
            "Changes of the cluster state (drains, traffic rules, tenants) applied here.",
            value=float(state.changes_applied),
        )

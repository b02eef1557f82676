"""One truth in etcd (``cluster/``), on a real etcd: the client (range, put, delete, watch,
a compacted revision, endpoints that fail), the keys read into a view, and gateways in
this process (the real app over fake engines) that share drains, traffic rules and
tenants through it; etcd down and back. The fleet of real gateway processes on the demo
model: ``test_etcd_fleet.py``. Both start their etcd with ``cluster_servers.EtcdServer``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from cluster_servers import EtcdServer, etcd_server, eventually, needs_etcd
from qrtest import ADMIN, ADMIN_KEY, fake_table, free_port, serving
from quantroute.api.app import create_app
from quantroute.api.gateway import Gateway
from quantroute.cluster import (
    ClusterState,
    EtcdClient,
    EtcdCompacted,
    EtcdUnavailable,
    Event,
    Layout,
    Snapshot,
    WatchBatch,
    keep_in_sync,
    read_view,
)
from quantroute.config import ClusterSettings, load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.resilience.tenants import Tenant, Tenants
from quantroute.routing.table import RouteTable, RouteTableRef
from quantroute.routing.versions import Rule, VersionSplit

pytestmark = needs_etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module's tests; each test keeps to its own prefix (cluster name)."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server


_names = iter(range(1_000_000))


def fleet_name() -> str:
    return f"t{os.getpid()}-{next(_names)}"


# -- the client ---------------------------------------------------------------------


async def test_the_client_reads_writes_and_deletes_the_keys_under_a_prefix(
    etcd: EtcdServer,
) -> None:
    client = EtcdClient([etcd.url], timeout_s=5)
    try:
        name = fleet_name()
        first = await client.put(f"/{name}/a", b'{"x": 1}')
        await client.put(f"/{name}/b", b"2")
        await client.put(f"/{name}x/c", b"not ours")  # a sibling prefix: /name is no prefix
        snap = await client.range_prefix(f"/{name}/")
        assert [(kv.key, kv.value) for kv in snap.items] == [
            (f"/{name}/a", b'{"x": 1}'),
            (f"/{name}/b", b"2"),
        ]
        assert snap.items[0].mod_revision == first
        assert snap.revision >= first + 2
        deleted_at = await client.delete(f"/{name}/a")
        assert deleted_at > snap.revision
        snap = await client.range_prefix(f"/{name}/")
        assert [kv.key for kv in snap.items] == [f"/{name}/b"]
        assert await client.revision() >= deleted_at
        assert (await client.range_prefix(f"/{fleet_name()}/")).items == ()
    finally:
        await client.aclose()


async def test_a_watch_sees_every_change_in_order_from_its_start_revision(
    etcd: EtcdServer,
) -> None:
    client = EtcdClient([etcd.url], timeout_s=5)
    name = fleet_name()
    try:
        before = await client.put(f"/{name}/early", b"1")  # before the watch: from its rev
        seen: list[tuple[str, bytes | None]] = []

        async def follow() -> None:
            async for batch in client.watch(f"/{name}/", before):
                seen.extend((e.key, e.value) for e in batch.events)

        task = asyncio.create_task(follow())
        await asyncio.to_thread(etcd.ctl, "put", f"/{name}/k", '{"state": "drained"}')
        await client.delete(f"/{name}/early")
        await client.put(f"/{fleet_name()}/other", b"x")  # another fleet's: not seen
        await eventually(lambda: len(seen) >= 3, within_s=5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert seen == [
            (f"/{name}/early", b"1"),
            (f"/{name}/k", b'{"state": "drained"}'),
            (f"/{name}/early", None),
        ]
    finally:
        await client.aclose()


class Recorder:
    """A ``Synced`` that records what the sync loop told it."""

    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self.batches: list[WatchBatch] = []
        self.lost_because: list[str] = []

    def synced(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)

    def changed(self, batch: WatchBatch) -> None:
        self.batches.append(batch)

    def lost(self, why: str) -> None:
        self.lost_because.append(why)


async def test_a_compacted_revision_is_read_again_whole_then_watched(etcd: EtcdServer) -> None:
    client = EtcdClient([etcd.url], timeout_s=5)
    name = fleet_name()
    try:
        old = await client.put(f"/{name}/a", b"1")
        await client.put(f"/{name}/a", b"2")
        latest = await client.put(f"/{name}/b", b"3")
        await asyncio.to_thread(etcd.ctl, "compaction", str(latest))
        with pytest.raises(EtcdCompacted) as caught:
            async for _ in client.watch(f"/{name}/", old):
                pass
        assert caught.value.compact_revision == latest
        state = Recorder()
        sync = asyncio.create_task(
            keep_in_sync(
                client,
                state,
                f"/{name}/",
                probe_interval_s=0.2,
                retry_max_s=0.5,
                watch_from=old,  # as if it had read at `old` and fallen behind
            )
        )
        await eventually(lambda: state.snapshots, within_s=5)
        (snap,) = state.snapshots
        assert {kv.key: kv.value for kv in snap.items} == {f"/{name}/a": b"2", f"/{name}/b": b"3"}
        assert not state.lost_because  # a compaction is no outage
        await client.put(f"/{name}/c", b"4")  # the watch runs from the read's revision + 1
        await eventually(lambda: state.batches, within_s=5)
        assert [e.key for b in state.batches for e in b.events] == [f"/{name}/c"]
        sync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sync
    finally:
        await client.aclose()


async def test_an_endpoint_that_does_not_answer_is_passed_over(etcd: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = EtcdClient([dead, etcd.url], timeout_s=2)
    try:
        name = fleet_name()
        await client.put(f"/{name}/a", b"1")
        assert client.endpoint == etcd.url  # tried first from now on
        assert len((await client.range_prefix(f"/{name}/")).items) == 1
    finally:
        await client.aclose()
    nobody = EtcdClient([dead], timeout_s=2)
    try:
        with pytest.raises(EtcdUnavailable, match=r"127\.0\.0\.1"):
            await nobody.range_prefix("/x/")
        with pytest.raises(EtcdUnavailable):
            async for _ in nobody.watch("/x/", 1):
                pass
    finally:
        await nobody.aclose()


# -- the keys, read into a view (pure) -----------------------------------------------


def test_the_keys_read_into_a_view_and_bad_values_are_named_not_applied() -> None:
    layout = Layout("prod")
    digest = hashlib.sha256(b"sk-acme").hexdigest()
    items = {
        layout.branch_admin("m:f16"): b'{"state": "drained", "reason": "disk"}',
        layout.branch_admin("m:q8_0"): b'{"state": "active"}',
        layout.branch_admin("m:bad"): b'{"state": "gone"}',
        layout.traffic("m"): b'{"traffic": [{"version": "v2", "header": "X-AB", "value": "b"},'
        b' {"version": "v2", "percent": 10}]}',
        layout.traffic("n"): b'{"traffic": [{"version": "v2", "percent": 60},'
        b' {"version": "v3", "percent": 50}]}',
        layout.tenant("acme"): json.dumps({"keys_sha256": [digest], "priority": 3}).encode(),
        layout.tenant("thief"): json.dumps({"keys_sha256": [digest]}).encode(),
        layout.tenant("short"): b'{"keys_sha256": ["abc"]}',
        layout.tenant("broken"): b"{not json",
        "/prod/redis/something": b"another part's key",
    }
    view = read_view(layout, items)
    assert dict(view.drained) == {"m:f16": "disk"}
    assert view.traffic["m"].rules == (Rule("v2", None, "x-ab", "b"), Rule("v2", 10.0))
    assert view.tenant_names == ("acme",)
    assert view.tenants == ((bytes.fromhex(digest), Tenant("acme", priority=3)),)
    assert set(view.problems) == {
        layout.branch_admin("m:bad"),
        layout.traffic("n"),
        layout.tenant("thief"),
        layout.tenant("short"),
        layout.tenant("broken"),
    }
    assert "add up to 110" in view.problems[layout.traffic("n")]
    assert "another tenant" in view.problems[layout.tenant("thief")]
    assert "sk-acme" not in json.dumps(dict(view.problems))


def test_tenants_replaced_close_an_open_api_and_never_reopen_it() -> None:
    tenants = Tenants()
    assert tenants.open
    acme = Tenant("acme")
    tenants.replace([(hashlib.sha256(b"sk-1").digest(), acme)])
    assert not tenants.open and tenants.find("sk-1") == acme and tenants.find("sk-2") is None
    tenants.replace([])
    assert not tenants.open  # a deleted record must not open the API
    assert tenants.find("sk-1") is None


def test_etcd_traffic_rules_replace_the_manifests_and_outlive_a_new_table() -> None:
    manifest_split = VersionSplit("m", "v1", (), ("v1", "v2"))
    routes = RouteTableRef(_versioned_table(manifest_split))
    state = ClusterState(ClusterSettings(name="p"), routes, lambda ids: None, Tenants())
    layout = state.layout
    state.synced(Snapshot((), 1))
    assert routes.current.splits["m"] is manifest_split
    rule = b'{"default_version": "v2", "traffic": [{"version": "v1", "percent": 25}]}'
    state.changed(_put(layout.traffic("m"), rule, 2))
    served = routes.current.splits["m"]
    assert (served.default, served.rules) == ("v2", (Rule("v1", 25.0),))
    assert served.versions == ("v1", "v2")
    table = routes.current
    assert state.overlay(table) is table  # nothing to change: no new table
    # a reload builds a table from the repository, with the manifest's rules again
    reloaded = VersionSplit("m", "v1", (Rule("v2", 5.0),), ("v1", "v2"))
    served = state.overlay(_versioned_table(reloaded)).splits["m"]
    assert (served.default, served.rules) == ("v2", (Rule("v1", 25.0),))
    routes.current = state.overlay(_versioned_table(reloaded))
    state.changed(_put(layout.traffic("m"), b'{"traffic": [{"version": "v9", "percent": 1}]}', 3))
    assert routes.current.splits["m"] is reloaded  # refused: the manifest's rules serve
    assert "no version v9" in state.status_json()["problems"][layout.traffic("m")]
    state.changed(WatchBatch((_delete(layout.traffic("m"), 4),), 4))
    assert routes.current.splits["m"] is reloaded
    assert state.changes_applied == 3


def _versioned_table(split: VersionSplit) -> RouteTable:
    routes = [fake_table({"f16": FakeEngine()}, f"m@{v}").models[f"m@{v}"] for v in ("v1", "v2")]
    return RouteTable.build(routes, splits=[split])


def _put(key: str, value: bytes, revision: int) -> WatchBatch:
    return WatchBatch((Event(key, value, revision),), revision)


def _delete(key: str, revision: int) -> Event:
    return Event(key, None, revision)


# -- gateways in this process, sharing one etcd ------------------------------------------


def _app(url: str | None, name: str, table: RouteTable | None = None, **cluster: Any) -> FastAPI:
    settings = load_settings(
        telemetry={"devices": "sim:1x24GiB"},
        server={"admin_key": ADMIN_KEY},
        routing={"retry_after_s": 0.5},
        cluster={"etcd_endpoints": [url] if url else [], "name": name, **cluster},
    )
    return create_app(settings, table or fake_table())


@contextlib.asynccontextmanager
async def _fleet(
    url: str | None, n: int, name: str | None = None, **cluster: Any
) -> AsyncIterator[list[tuple[httpx.AsyncClient, Gateway]]]:
    name = name or fleet_name()
    async with contextlib.AsyncExitStack() as stack:
        gateways = [
            await stack.enter_async_context(serving(_app(url, name, **cluster))) for _ in range(n)
        ]
        yield gateways


PIN_F16 = {"model": "tiny-llama:f16", "prompt": "x", "max_tokens": 2}
EXACT = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "quality": "exact"}


async def _status(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/admin/status", headers=ADMIN)
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


async def test_without_etcd_a_drain_is_this_gateways_own() -> None:
    async with _fleet(None, 2) as [(a, _), (b, _)]:
        r = await a.post("/admin/branches/tiny-llama:f16/drain", headers=ADMIN)
        assert r.status_code == 200 and r.json()["store"] == "local", r.text
        r = await a.post("/v1/completions", json=PIN_F16)
        assert r.status_code == 503 and "tiny-llama:f16 is drained" in r.text
        assert r.headers["retry-after"]
        assert (await b.post("/v1/completions", json=PIN_F16)).status_code == 200
        status = await _status(a)
        assert status["cluster"]["state"] == "local" and not status["cluster"]["degraded"]
        assert status["branches"]["tiny-llama:f16"]["state"] == "drained"
        r = await a.post("/admin/branches/tiny-llama:f16/undrain", headers=ADMIN)
        assert r.json()["state"] == "active"
        assert (await a.post("/v1/completions", json=PIN_F16)).status_code == 200
        wrong = {"authorization": "Bearer not-the-admin-key"}
        r = await a.post("/admin/branches/tiny-llama:f16/drain", headers=wrong)
        assert r.status_code in (401, 403)
        r = await a.post("/admin/branches/tiny-llama:nope/drain", headers=ADMIN)
        assert r.status_code == 404


async def test_a_drain_on_one_gateway_refuses_requests_on_another_within_a_second(
    etcd: EtcdServer,
) -> None:
    name = fleet_name()
    async with _fleet(etcd.url, 3, name) as [(a, _), (b, _), (c, gateway_c)]:
        f16 = gateway_c.routes.current.models["tiny-llama"].branch("f16")
        assert f16 is not None
        r = await b.post("/v1/completions", json=EXACT)
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] == "tiny-llama:f16"
        r = await a.post("/admin/branches/tiny-llama:f16/drain", headers=ADMIN)
        assert r.status_code == 200 and r.json()["store"] == "etcd", r.text
        # in force on the gateway that took it when it answers, on the others within 1 s
        assert (await a.post("/v1/completions", json=PIN_F16)).status_code == 503

        async def refused(client: httpx.AsyncClient) -> bool:
            r = await client.post("/v1/completions", json=EXACT)
            return r.status_code == 503 and "tiny-llama:f16 is drained" in r.text

        for client in (b, c):
            took = await eventually(lambda client=client: refused(client), within_s=1.0)
            assert took < 1.0
        r = await c.post("/v1/completions", json={**EXACT, "quality": "fast"})
        assert r.status_code == 200 and r.headers["x-quantroute-branch"] != "tiny-llama:f16"
        status = (await _status(c))["cluster"]
        assert status["state"] == "connected" and status["drained"] == {"tiny-llama:f16": None}
        assert (await _status(c))["branches"]["tiny-llama:f16"]["state"] == "drained"
        assert f16.engine.ready  # loaded still: undraining lets traffic back at once
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert "quantroute_cluster_etcd_connected 1.0" in metrics
        assert "quantroute_cluster_changes_applied_total 1.0" in metrics
        # an operator's etcdctl is the same as the admin API
        await asyncio.to_thread(etcd.ctl, "del", Layout(name).branch_admin("tiny-llama:f16"))
        for client in (a, b, c):
            await eventually(
                lambda client=client: _served(client, EXACT, "tiny-llama:f16"), within_s=1.0
            )


async def _served(client: httpx.AsyncClient, body: dict[str, Any], branch: str) -> bool:
    r = await client.post("/v1/completions", json=body)
    return r.status_code == 200 and r.headers["x-quantroute-branch"] == branch


async def test_tenants_in_etcd_are_every_gateways_keys(etcd: EtcdServer) -> None:
    name = fleet_name()
    async with _fleet(etcd.url, 2, name) as [(a, _), (b, _)]:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2}
        assert (await a.post("/v1/completions", json=body)).status_code == 200  # open
        record = {
            "keys_sha256": [hashlib.sha256(b"sk-acme-1").hexdigest()],
            "models": ["tiny-llama"],
            "max_concurrency": 4,
        }
        await asyncio.to_thread(etcd.ctl, "put", Layout(name).tenant("acme"), json.dumps(record))
        key = {"authorization": "Bearer sk-acme-1"}
        for client in (a, b):
            await eventually(lambda client=client: _status_is(client, body, {}, 401), within_s=1.0)
            r = await client.post("/v1/completions", json=body, headers=key)
            assert r.status_code == 200
        status = (await _status(b))["cluster"]
        assert status["tenants"] == {"source": "etcd", "names": ["acme"]}
        assert "sk-acme-1" not in json.dumps(status)
        await asyncio.to_thread(etcd.ctl, "del", Layout(name).tenant("acme"))
        for client in (a, b):  # no tenant left: no key is valid, and the API stays closed
            await eventually(lambda client=client: _status_is(client, body, key, 401))
            assert (await client.post("/v1/completions", json=body)).status_code == 401


async def _status_is(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], status: int
) -> bool:
    r = await client.post("/v1/completions", json=body, headers=headers)
    return r.status_code == status


async def test_etcd_down_keeps_the_last_state_says_degraded_and_converges_when_back(
    tmp_path: Path,
) -> None:
    with etcd_server(tmp_path) as etcd:
        name = fleet_name()
        async with _fleet(etcd.url, 2, name, etcd_probe_interval_s=0.2, etcd_retry_max_s=0.5) as [
            (a, _),
            (b, _),
        ]:
            r = await a.post("/admin/branches/tiny-llama:f16/drain", headers=ADMIN)
            assert r.status_code == 200
            await eventually(lambda: _status_is(b, PIN_F16, {}, 503))
            etcd.kill()
            for client in (a, b):
                await eventually(lambda client=client: _degraded(client), within_s=3.0, step_s=0.05)
                status = (await _status(client))["cluster"]
                assert status["degraded_since"] <= time.time()
                assert status["last_error"]
                # serving goes on, with the last state read: f16 stays drained
                assert (await client.post("/v1/completions", json=PIN_F16)).status_code == 503
                r = await client.post(
                    "/v1/completions", json={**PIN_F16, "model": "tiny-llama", "quality": "fast"}
                )
                assert r.status_code == 200
            metrics = (await b.get("/metrics", headers=ADMIN)).text
            assert "quantroute_cluster_etcd_connected 0.0" in metrics
            r = await a.post("/admin/branches/tiny-llama:f16/undrain", headers=ADMIN)
            assert r.status_code == 503 and "etcd" in r.text  # not recorded: nothing changed
            assert (await a.post("/v1/completions", json=PIN_F16)).status_code == 503
            etcd.start()
            for client in (a, b):
                await eventually(
                    lambda client=client: _connected(client), within_s=5.0, step_s=0.05
                )
            await asyncio.to_thread(etcd.ctl, "del", Layout(name).branch_admin("tiny-llama:f16"))
            for client in (a, b):
                await eventually(lambda client=client: _served(client, PIN_F16, "tiny-llama:f16"))


async def _degraded(client: httpx.AsyncClient) -> bool:
    status = (await _status(client))["cluster"]
    return bool(status["degraded"]) and status["state"] == "degraded"


async def _connected(client: httpx.AsyncClient) -> bool:
    status = (await _status(client))["cluster"]
    return status["state"] == "connected" and status["degraded_since"] is None


async def test_a_gateway_whose_etcd_is_down_at_start_serves_degraded_then_syncs(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path)
    name = fleet_name()
    async with _fleet(etcd.url, 1, name, etcd_timeout_s=0.5, etcd_retry_max_s=0.3) as [(a, _)]:
        assert (await _status(a))["cluster"]["degraded"]
        assert (await a.post("/v1/completions", json=PIN_F16)).status_code == 200
        etcd.start()
        try:
            etcd.ctl("put", Layout(name).branch_admin("tiny-llama:f16"), '{"state": "drained"}')
            await eventually(lambda: _status_is(a, PIN_F16, {}, 503), within_s=5.0)
            assert (await _status(a))["cluster"]["state"] == "connected"
        finally:
            etcd.kill()


async def test_an_etcd_that_stops_answering_on_an_open_connection_is_noticed(
    tmp_path: Path,
) -> None:
    """A frozen etcd (SIGSTOP: as a partition looks) keeps the watch's connection open and
    says nothing: the probe notices within its interval and the request time limit."""
    import signal

    with etcd_server(tmp_path) as etcd:
        assert etcd.proc is not None
        timings = {"etcd_probe_interval_s": 0.2, "etcd_timeout_s": 0.3, "etcd_retry_max_s": 0.3}
        async with _fleet(etcd.url, 1, **timings) as [(a, _)]:
            await eventually(lambda: _connected(a), within_s=2.0)
            etcd.proc.send_signal(signal.SIGSTOP)
            try:
                took = await eventually(lambda: _degraded(a), within_s=3.0, step_s=0.05)
                assert took < 1.5
                assert (await a.post("/v1/completions", json=PIN_F16)).status_code == 200
            finally:
                etcd.proc.send_signal(signal.SIGCONT)
            await eventually(lambda: _connected(a), within_s=5.0, step_s=0.05)

"""Versions and traffic splits: a 10% canary over 10,000 users, stickiness, A/B headers,
pinned versions, and the answering version in the response."""

from __future__ import annotations

from pathlib import Path

import pytest

from qrtest import serving
from quantroute.api.app import create_app
from quantroute.config import load_settings
from quantroute.engines.fake import FakeEngine
from quantroute.errors import NotFoundError
from quantroute.registry.manifest import BranchArtifact
from quantroute.routing.table import Branch, ModelRoute, RouteTable, lookup
from quantroute.routing.versions import Audience, Rule, VersionSplit, user_bucket
from quantroute.types import Precision

CANARY = VersionSplit("m", "v1", (Rule("v2", percent=10.0),), ("v1", "v2"))


def test_a_10_percent_canary_sends_10_percent_of_10000_users_and_sticks() -> None:
    users = [f"user-{i}" for i in range(10_000)]
    first = {u: CANARY.pick(Audience(user=u)) for u in users}
    share = sum(v == "v2" for v in first.values()) / len(users)
    assert 0.085 <= share <= 0.115, share
    assert all(CANARY.pick(Audience(user=u)) == first[u] for u in users)  # sticky


def test_buckets_are_stable_and_independent_between_models() -> None:
    assert user_bucket("m", "alice") == user_bucket("m", "alice")
    assert user_bucket("m", "alice") == 7873  # sha256: the same on every host and run
    same = sum(user_bucket("a", f"u{i}") == user_bucket("b", f"u{i}") for i in range(1000))
    assert same < 10


@pytest.mark.parametrize(
    ("rules", "who", "version"),
    [
        (
            (Rule("v2", header="x-ab-group", value="b"),),
            Audience(headers={"x-ab-group": "b"}),
            "v2",
        ),
        (
            (Rule("v2", header="x-ab-group", value="b"),),
            Audience(headers={"x-ab-group": "a"}),
            "v1",
        ),
        ((Rule("v2", percent=100.0),), Audience(user="anyone"), "v2"),
        ((Rule("v2", percent=100.0),), Audience(), "v1"),  # no user: the default
        (
            (Rule("v3", header="x-ab-group", value="c"), Rule("v2", percent=100.0)),
            Audience(user="u", headers={"x-ab-group": "c"}),
            "v3",  # a header rule first
        ),
    ],
)
def test_rules(rules: tuple[Rule, ...], who: Audience, version: str) -> None:
    assert VersionSplit("m", "v1", rules).pick(who) == version


def test_percentages_stack_in_rule_order() -> None:
    split = VersionSplit("m", "v1", (Rule("v2", percent=20.0), Rule("v3", percent=30.0)))
    picks = [split.pick(Audience(user=f"u{i}")) for i in range(10_000)]
    assert 0.185 <= picks.count("v2") / 10_000 <= 0.215
    assert 0.285 <= picks.count("v3") / 10_000 <= 0.315


def test_the_user_field_comes_before_the_header() -> None:
    assert Audience.of("body", {"x-quantroute-user": "header"}).user == "body"
    assert Audience.of(None, {"x-quantroute-user": "header"}).user == "header"
    assert Audience.of(None, {}).user is None


def versioned_table() -> RouteTable:
    routes = []
    for version in ("v1", "v2"):
        name = f"m@{version}"
        branches = []
        for precision in ("f16", "q4_k_m"):
            artifact = BranchArtifact(
                "m",
                precision,
                Precision(precision),
                "fake",
                Path(f"/nonexistent/{version}/{precision}.gguf"),
                (version[-1] * 64),
                0,
                precision == "f16",
                version=version,
            )
            branches.append(Branch(name, precision, Precision(precision), artifact, FakeEngine()))
        routes.append(ModelRoute(name, "f16", tuple(branches)))
    return RouteTable.build(routes, splits=[CANARY])


def test_lookup_picks_pins_and_refuses_unknown_versions() -> None:
    table = versioned_table()
    canary_user = next(f"u{i}" for i in range(1000) if CANARY.pick(Audience(user=f"u{i}")) == "v2")
    assert lookup(table, "m", Audience(user=canary_user))[0].name == "m@v2"
    assert lookup(table, "m")[0].name == "m@v1"
    route, branch = lookup(table, "m@v2:q4_k_m")
    assert route.version == "v2" and branch is not None and branch.id == "m@v2:q4_k_m"
    with pytest.raises(NotFoundError, match="no such version; its versions are v1, v2"):
        lookup(table, "m@v9")
    with pytest.raises(NotFoundError, match="Models served here: m, m@v1, m@v2"):
        lookup(table, "other")


async def test_the_answering_version_is_in_the_response_and_counted() -> None:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server={"admin_key": "k"})
    app = create_app(settings, versioned_table())
    admin = {"authorization": "Bearer k"}
    async with serving(app) as (client, _gateway):
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        seen = {}
        for i in range(40):
            r = await client.post("/v1/completions", json=body | {"user": f"u{i}"})
            assert r.status_code == 200, r.text
            seen[f"u{i}"] = r.headers["x-quantroute-version"]
            assert r.headers["x-quantroute-branch"].startswith(f"m@{seen[f'u{i}']}:")
        assert seen == {u: CANARY.pick(Audience(user=u)) for u in seen}
        r = await client.post("/v1/completions", json=body, headers={"x-quantroute-user": "u3"})
        assert r.headers["x-quantroute-version"] == seen["u3"]  # sticky by the header too
        r = await client.post("/v1/completions", json=body | {"model": "m@v2"})
        assert r.headers["x-quantroute-version"] == "v2"  # pinned
        r = await client.post("/v1/completions", json=body | {"model": "m@v7"})
        assert r.status_code == 404 and "its versions are v1, v2" in r.text
        models = (await client.get("/v1/models")).json()["data"]
        entry = next(m for m in models if m["id"] == "m")
        assert entry["versions"] == ["v1", "v2"] and entry["default_version"] == "v1"
        assert entry["traffic"] == [{"version": "v2", "percent": 10.0}]
        status = (await client.get("/admin/status", headers=admin)).json()
        answered = status["versions_answered"]
        by_header = seen["u3"] == "v2"
        assert answered["m@v2"] == sum(v == "v2" for v in seen.values()) + by_header + 1
        assert sum(answered.values()) == 42


async def test_a_gateway_given_a_fixed_table_refuses_to_reload() -> None:
    settings = load_settings(telemetry={"devices": "sim:1x24GiB"}, server={"admin_key": "k"})
    async with serving(create_app(settings, versioned_table())) as (client, gateway):
        r = await client.post("/admin/reload", headers={"authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["outcome"] == "failed"
        assert "no repository" in r.json()["failures"]["repository"]
        assert set(gateway.routes.current.models) == {"m@v1", "m@v2"}  # still serving

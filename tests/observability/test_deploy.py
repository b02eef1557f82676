"""deploy/: the alert rules pass ``promtool check rules`` and their unit tests; the Grafana
dashboard's and the rules' queries name only metrics the server exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from qrtest import fake_app, serving
from tools import need_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
NAME = re.compile(r"\bquantroute_[a-z0-9_]+")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = need_tool("promtool", "prometheus")
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent
    )


def test_alert_rules_pass_promtool_check() -> None:
    done = _promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    done = _promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_cover_what_operators_are_paged_for() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    assert alerts == {
        "QuantrouteFallbackSpike",
        "QuantrouteBranchDrifting",
        "QuantrouteDeviceMemoryHigh",
        "QuantrouteBreakerOpen",
        "QuantrouteWorkerRestarting",
        "QuantrouteBranchFailed",
    }


def _dashboard_exprs() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "quantroute.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]] + [
        a for g in groups for r in g["rules"] for a in r["annotations"].values()
    ]


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names.update(name + s for s in suffixes)
    return names


async def test_dashboard_and_rules_query_only_exported_metrics() -> None:
    async with serving(fake_app()) as (client, _):
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        exported = exported_names((await client.get("/metrics")).text)
    dashboard = {n for e in _dashboard_exprs() for n in NAME.findall(e)}
    rules = {n for e in _rule_exprs() for n in NAME.findall(e)}
    assert len(dashboard) >= 20  # the extraction found the dashboard's queries
    assert not dashboard - exported, f"unknown metrics: {dashboard - exported}"
    assert not rules - exported, f"the alert rules query unknown metrics: {rules - exported}"
    # and the dashboard shows every family the issue asks operators to see
    for name in (
        "quantroute_fallback_total",
        "quantroute_time_to_first_token_seconds_bucket",
        "quantroute_inter_token_latency_seconds_bucket",
        "quantroute_device_temperature_celsius",
        "quantroute_prompt_cache_hit_tokens_total",
        "quantroute_hot_reloads_total",
    ):
        assert name in dashboard, name

"""What deploy/kubernetes scales and alerts on is what quantroute exports: every metric a
ScaledObject's query or a PrometheusRule names is on the real app's ``/metrics`` (with
a remote branch, a real ``OpenAIEngine`` on a fake upstream), the queries and rules pass
``promtool check rules``, and the gauges added for them say what they should:
``quantroute_device_free_ratio`` is free / total, a remote branch's KV usage, load and
health are its engine's ``health()``."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from qrtest import ADMIN, ADMIN_KEY, fake_table, serving
from quantroute.engines.fake import FakeEngine
from quantroute.engines.openai.engine import OpenAIEngine, RemoteConfig
from quantroute.observability.metrics import (
    BranchSample,
    DeviceSample,
    ModelSample,
    RemoteSample,
    remote_sample,
    render_metrics,
)
from tools import need_tool
from upstream import FakeUpstream

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NAME = re.compile(r"\bquantroute_[a-z0-9_]+")
# what a vLLM says of its load (engines/openai/load.py reads these names)
VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="ok"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="ok"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="ok"} 0.5
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _docs(kind: str) -> list[dict[str, Any]]:
    return [
        d
        for path in sorted(K8S.rglob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if isinstance(d, dict) and d.get("kind") == kind
    ]


def _scaling_queries() -> list[str]:
    return [t["metadata"]["query"] for s in _docs("ScaledObject") for t in s["spec"]["triggers"]]


def _rules() -> list[dict[str, Any]]:
    return [r for d in _docs("PrometheusRule") for g in d["spec"]["groups"] for r in g["rules"]]


def _samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _exported(text: str) -> set[str]:
    """Every series name the exposition declares (``# TYPE``), with samples or not."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"histogram": ("_bucket", "_sum", "_count")}.get(kind, ("",))
            names.update(name + s for s in suffixes)
    return names


class _Health:
    def __init__(self, report: object):
        self.report = report

    def health(self) -> object:
        return self.report


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (
            {"healthy": True, "kv_usage": 0.5, "running": 3, "waiting": 1},
            RemoteSample(True, 0.5, 3, 1),
        ),
        (
            {"healthy": False, "kv_usage": None, "running": None, "waiting": None},
            RemoteSample(False, None, None, None),
        ),
        (
            {"healthy": "yes", "kv_usage": 1.7, "running": -1, "waiting": True},
            RemoteSample(False, 1.0, None, None),
        ),  # only True is up; a ratio is clamped
        ({"healthy": True, "kv_usage": math.nan}, RemoteSample(True, None, None, None)),
        ({"healthy": True, "kv_usage": True}, RemoteSample(True, None, None, None)),
        ("not a mapping", None),
    ],
)
def test_remote_sample_reads_an_engines_health(report: object, expected: object) -> None:
    assert remote_sample(_Health(report)) == expected


def test_an_engine_without_health_has_no_remote_sample() -> None:
    assert remote_sample(FakeEngine()) is None
    assert remote_sample(object()) is None


class _View:
    def __init__(self, branches: list[BranchSample], devices: list[DeviceSample]):
        self.branches, self.devices = branches, devices

    def branch_samples(self) -> list[BranchSample]:
        return self.branches

    def device_samples(self) -> tuple[list[DeviceSample], float]:
        return self.devices, 0.5

    def model_samples(self) -> list[ModelSample]:
        return [ModelSample("m", 2, 1)]


def _branch(name: str, remote: RemoteSample | None) -> BranchSample:
    return BranchSample(
        "m", name, name, True, False, False, 0, "", 0, False, None, None, remote=remote
    )


def test_the_collector_shows_remote_servers_and_free_ratios() -> None:
    view = _View(
        [
            _branch("f16", None),
            _branch("fp8", RemoteSample(True, 0.5, 3, 1)),
            _branch("awq", RemoteSample(False)),  # down: no figures, up 0
        ],
        [
            DeviceSample("cuda:0", "cuda", 80 << 30, 20 << 30, 16 << 30, 1.0),
            DeviceSample("cpu", "cpu", 0, 0, 0, 1.0),  # no total: no ratio
        ],
    )
    s = _samples(render_metrics(view).decode())
    assert _value(s, "quantroute_device_free_ratio", device="cuda:0", kind="cuda") == 0.25
    assert _value(s, "quantroute_device_free_ratio", device="cpu") is None
    assert _value(s, "quantroute_branch_remote_kv_usage_ratio", branch="fp8") == 0.5
    assert _value(s, "quantroute_branch_remote_up", branch="fp8") == 1
    assert _value(s, "quantroute_branch_remote_running_requests", branch="fp8") == 3
    assert _value(s, "quantroute_branch_remote_waiting_requests", branch="fp8") == 1
    assert _value(s, "quantroute_branch_remote_up", branch="awq") == 0
    assert _value(s, "quantroute_branch_remote_kv_usage_ratio", branch="awq") is None
    for name in ("up", "kv_usage_ratio", "running_requests", "waiting_requests"):
        assert _value(s, f"quantroute_branch_remote_{name}", branch="f16") is None


async def test_what_keda_and_the_alerts_read_is_what_the_app_exports() -> None:
    """The real app with a local branch and a remote one (an ``OpenAIEngine`` whose
    upstream's metrics say its KV cache is half full), on a simulated 24 GiB device
    under pressure: every name the ScaledObjects and the rules query is exported, and
    the gauges the engines scale on carry the engine's and the device's figures."""
    from quantroute.api.app import create_app
    from quantroute.config import load_settings

    async with FakeUpstream() as upstream:
        upstream.metrics = VLLM_METRICS
        remote = OpenAIEngine("tiny-llama:fp8", RemoteConfig(url=upstream.url, model="ok"))
        settings = load_settings(
            telemetry={"devices": "sim:1x24GiB"}, server={"admin_key": ADMIN_KEY}
        )
        app = create_app(settings, fake_table({"f16": FakeEngine(), "fp8": remote}))
        async with serving(app) as (client, gateway):
            pressure = {"bytes": 6 << 30}
            put = await client.put("/admin/devices/sim:0/pressure", json=pressure, headers=ADMIN)
            assert put.status_code == 200
            await gateway.poller.poll_once()
            body = {"model": "tiny-llama:f16", "prompt": "x", "max_tokens": 3}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            text = (await client.get("/metrics", headers=ADMIN)).text
            device = gateway.poller.snapshot.device("sim:0")
    exported = _exported(text)
    queried = {n for q in _scaling_queries() for n in NAME.findall(q)}
    alerted = {
        n
        for r in _rules()
        for e in (r["expr"], *r["annotations"].values())
        for n in NAME.findall(str(e))
    }
    assert {
        "quantroute_queue_depth",
        "quantroute_device_free_ratio",
        "quantroute_branch_remote_kv_usage_ratio",
    } <= queried
    assert not queried - exported, f"the ScaledObjects query unknown metrics: {queried - exported}"
    assert not alerted - exported, f"the alerts query unknown metrics: {alerted - exported}"

    s = _samples(text)
    assert device is not None
    ratio = _value(s, "quantroute_device_free_ratio", device="sim:0", kind="sim")
    assert ratio == pytest.approx(device.free_bytes / device.total_bytes)
    assert ratio is not None and ratio < 1 - 6 / 24 + 1e-9  # the pressure shows
    assert _value(s, "quantroute_branch_remote_kv_usage_ratio", branch="fp8") == 0.5
    assert _value(s, "quantroute_branch_remote_up", branch="fp8") == 1
    assert _value(s, "quantroute_branch_remote_running_requests", branch="fp8") == 3
    assert _value(s, "quantroute_branch_remote_waiting_requests", branch="fp8") == 1
    assert _value(s, "quantroute_branch_remote_up", branch="f16") is None  # local: none


def test_the_queries_and_the_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = need_tool("promtool", "prometheus")
    groups = [g for d in _docs("PrometheusRule") for g in d["spec"]["groups"]]
    recorded = [{"record": f"keda:query_{i}", "expr": q} for i, q in enumerate(_scaling_queries())]
    groups.append({"name": "keda-queries", "rules": recorded})
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules()) + len(recorded)} rules found" in done.stdout

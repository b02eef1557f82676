"""deploy/kubernetes, offline: every manifest passes Kubernetes' own schemas
(kubernetes-validate, strict: a misspelt field fails), KEDA's and the Prometheus
Operator's kinds pass schemas written from their docs (``schemas/``); each kustomization
names every file; the parts name each other consistently (Services and the workloads they
select, ScaledObjects and their Deployments, the model manifest's remote branches and
their engines, the Secret's keys and deploy/README.md); pods meet the restricted Pod
Security Standard the namespace enforces; the gateway's settings file loads with its pod's
environment; the fetch job's script writes a model the repository accepts; the probes'
paths are the app's routes. tests/deploy/test_kubernetes_metrics.py holds the queries to
the metrics the server exports."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from qrtest import demo_model_dir, fake_app

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
JOBS = K8S / "jobs"  # one-shot Jobs, applied by hand in order (deploy/README.md)
KUSTOMIZATIONS = (K8S, K8S / "fleet")
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
}
# the oldest Kubernetes still widely run, and the newest kubernetes-validate knows
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SECRET = "quantroute"  # the Secret the operator creates (deploy/README.md)

Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomization(folder: Path) -> Doc:
    doc: Doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return doc


def _generator_files(kust: Doc) -> list[str]:
    return [
        entry.partition("=")[2] or entry
        for gen in kust.get("configMapGenerator", [])
        for entry in gen.get("files", [])
    ]


def _resources(folder: Path) -> list[Doc]:
    """What the kustomization in ``folder`` applies, as kustomize would: its resources
    with its namespace, and the ConfigMaps it generates."""
    kust = _kustomization(folder)
    docs = [d for name in kust["resources"] for d in _docs(folder / name)]
    for gen in kust.get("configMapGenerator", []):
        data = {}
        for entry in gen["files"]:
            key, _, file = entry.rpartition("=") if "=" in entry else ("", "", entry)
            data[key or Path(file).name] = (folder / file).read_text()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    for doc in docs:
        if doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = kust["namespace"]
    return docs


def _jobs() -> list[Doc]:
    return [d for path in sorted(JOBS.glob("*.yaml")) for d in _docs(path)]


BASE = _resources(K8S)
FLEET = _resources(K8S / "fleet")
EVERYTHING = BASE + FLEET + _jobs()


def _find(kind: str, name: str, docs: list[Doc] = BASE) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def _workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def _validate(doc: Doc, version: str) -> None:
    schema_file = CRDS.get((doc["apiVersion"], doc["kind"]))
    if schema_file is None:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    schema = json.loads((SCHEMAS / schema_file).read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    if doc["kind"] == "ScaledObject":  # KEDA makes an HPA of it: validate that too
        spec = doc["spec"]
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{doc['metadata']['name']}"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": spec["scaleTargetRef"]["name"],
                },
                "minReplicas": max(1, spec.get("minReplicaCount", 0)),
                "maxReplicas": spec.get("maxReplicaCount", 100),
            },
        }
        behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
        if "behavior" in behavior:
            hpa["spec"]["behavior"] = behavior["behavior"]
        kubernetes_validate.validate(hpa, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_schemas(version: str) -> None:
    kinds = set()
    for doc in EVERYTHING:
        try:
            _validate(doc, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
        kinds.add(doc["kind"])
    assert {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "StatefulSet",
        "Job",
        "PersistentVolumeClaim",
        "ScaledObject",
        "ServiceMonitor",
        "PrometheusRule",
    } <= kinds


@pytest.mark.parametrize("schema", sorted(CRDS.values()))
def test_the_crd_schemas_are_json_schemas(schema: str) -> None:
    jsonschema.Draft202012Validator.check_schema(json.loads((SCHEMAS / schema).read_text()))


def test_the_validation_rejects_what_a_cluster_would() -> None:
    """The checks bite: a misspelt field, a prometheus trigger without its threshold."""
    deployment = copy.deepcopy(_find("Deployment", "quantroute"))
    _pod(deployment)["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, VERSIONS[-1])
    scaled = copy.deepcopy(_find("ScaledObject", "quantroute"))
    del scaled["spec"]["triggers"][0]["metadata"]["threshold"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled, VERSIONS[-1])
    scaled = copy.deepcopy(_find("ScaledObject", "quantroute"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA takes strings only
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled, VERSIONS[-1])


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_each_kustomization_names_every_file(folder: Path) -> None:
    kust = _kustomization(folder)
    named = {*kust["resources"], *_generator_files(kust), "kustomization.yaml"}
    others = [k.parent for k in folder.rglob("kustomization.yaml") if k.parent != folder]
    present = {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and not any(p.is_relative_to(o) for o in [*others, JOBS])
    }
    assert present == named, f"not named: {present - named}; missing: {named - present}"


def test_the_jobs_stand_alone() -> None:
    """jobs/ is applied file by file: each names its namespace and runs the gateway's image."""
    images = _kustomization(K8S)["images"]
    image = next(i for i in images if i["name"] == "quantroute")
    gateway_image = f"{image['newName']}:{image['newTag']}"
    jobs = _jobs()
    assert {j["metadata"]["name"] for j in jobs} == {"fetch-model", "profile-model"}
    for job in jobs:
        assert job["kind"] == "Job"
        assert job["metadata"]["namespace"] == _kustomization(K8S)["namespace"]
        assert [c["image"] for c in _pod(job)["containers"]] == [gateway_image]


def test_kustomize_builds_the_base_and_the_fleet() -> None:
    """kubectl's own kustomize, where kubectl is installed (no Debian package ships a
    current one, so this one check is optional; the rest of the file reads the same
    files without it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` is not run")
    for folder in KUSTOMIZATIONS:
        done = subprocess.run(
            [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        built = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
        assert len(built) == len(_resources(folder))
        for doc in built:
            _validate(doc, VERSIONS[-1])
            assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "quantroute"
            assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "quantroute"
        if folder == K8S:  # the settings' ConfigMap is hashed, and the gateway follows it
            gateway = _find("Deployment", "quantroute", built)
            volumes = {v["name"]: v for v in _pod(gateway)["volumes"]}
            name = volumes["config"]["configMap"]["name"]
            assert name.startswith("quantroute-config-")
            assert any(d["kind"] == "ConfigMap" and d["metadata"]["name"] == name for d in built)
            assert _pod(gateway)["containers"][0]["image"] == "quantroute:0.1.0"


@pytest.mark.parametrize(
    "workload", _workloads(EVERYTHING), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)
def test_pods_meet_the_restricted_pod_security_standard(workload: Doc) -> None:
    """The namespace enforces `restricted` (namespace.yaml): a pod short of it is refused
    at admission, which no offline schema sees."""
    pod = _pod(workload)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False  # no FOO_PORT=tcp://... beside QUANTROUTE_*
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context.get("privileged", False)


def test_the_namespace_enforces_the_restricted_standard() -> None:
    labels = _find("Namespace", "quantroute")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize(
    "service",
    [d for d in BASE + FLEET if d["kind"] == "Service"],
    ids=lambda d: d["metadata"]["name"],
)
def test_each_service_selects_one_workload_and_its_port(service: Doc) -> None:
    selector = service["spec"]["selector"]
    chosen = [
        w
        for w in _workloads(BASE + FLEET)
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(chosen) == 1, [w["metadata"]["name"] for w in chosen]
    ports = {p["name"] for c in _pod(chosen[0])["containers"] for p in c.get("ports", [])}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports


def test_every_deployment_is_scaled_by_keda_and_leaves_it_the_count() -> None:
    deployments = {d["metadata"]["name"]: d for d in BASE if d["kind"] == "Deployment"}
    scaled = [d for d in BASE if d["kind"] == "ScaledObject"]
    targets = [s["spec"]["scaleTargetRef"]["name"] for s in scaled]
    assert sorted(targets) == sorted(deployments)  # each once
    for name, deployment in deployments.items():
        assert "replicas" not in deployment["spec"], f"{name}: an apply would undo KEDA's count"
    for s in scaled:
        assert {t["type"] for t in s["spec"]["triggers"]} == {"prometheus"}
        assert s["spec"]["minReplicaCount"] >= 1  # a remote branch never scales to nothing


def _queries(name: str) -> list[str]:
    return [t["metadata"]["query"] for t in _find("ScaledObject", name)["spec"]["triggers"]]


def test_the_gateways_scale_on_queue_depth_and_their_gpus_memory() -> None:
    queries = _queries("quantroute")
    assert 'sum(quantroute_queue_depth{namespace="quantroute"})' in queries
    assert any("1 - quantroute_device_free_ratio" in q and 'kind="cuda"' in q for q in queries)
    pdb = _find("PodDisruptionBudget", "quantroute")
    gateway = _find("Deployment", "quantroute")
    assert pdb["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    assert _find("ScaledObject", "quantroute")["spec"]["minReplicaCount"] >= 2


def _manifest_template(tmp_path: Path) -> Any:
    """The model's manifest as quantroute reads it, with a digest in place of the one the
    fetch job fills in."""
    from quantroute.engines.table import ENGINES
    from quantroute.registry.manifest import load_manifest

    text = (K8S / "files" / "model-manifest.yaml").read_text().replace("${F16_SHA256}", "0" * 64)
    folder = tmp_path / yaml.safe_load(text)["model"]
    folder.mkdir()
    (folder / "quantroute.yaml").write_text(text)
    return load_manifest(folder, ENGINES)


def _arg(container: Doc, flag: str) -> str:
    args: list[str] = [*container.get("command", []), *container["args"]]
    return args[args.index(flag) + 1]


def test_each_remote_branch_reaches_its_engine_which_scales_on_its_memory(
    tmp_path: Path,
) -> None:
    """The manifest's url is a Service of the base, whose engine serves the manifest's
    remote_model under the key the gateway holds; its ScaledObject reads that branch."""
    manifest = _manifest_template(tmp_path)
    gateway = _pod(_find("Deployment", "quantroute"))["containers"][0]
    gateway_env = {e["name"] for e in gateway["env"]}
    remote = {name: spec for name, spec in manifest.branches.items() if spec.url is not None}
    assert set(remote) == {"q4_k_m", "fp8", "awq"}
    assert any(spec.url is None for spec in manifest.branches.values())  # and a local one
    for name, spec in remote.items():
        url = urlsplit(spec.url)
        service = _find("Service", url.hostname or "")
        assert url.port in [p["port"] for p in service["spec"]["ports"]]
        deployment = _find("Deployment", service["metadata"]["name"])
        engine = _pod(deployment)["containers"][0]
        served = "--alias" if "llama.cpp" in engine["image"] else "--served-model-name"
        assert _arg(engine, served) == spec.remote_model
        assert spec.api_key_env in gateway_env
        refs = [e.get("valueFrom", {}).get("secretKeyRef", {}) for e in engine["env"]]
        keys = {ref["key"] for ref in refs if ref.get("name") == SECRET}
        assert keys == {"engines-api-key"}
        probes = ("startupProbe", "readinessProbe", "livenessProbe")
        assert {engine[p]["httpGet"]["path"] for p in probes} == {"/health"}
        queries = _queries(deployment["metadata"]["name"])
        selector = f'model="{manifest.model}", branch="{name}"'
        assert queries and all(selector in q for q in queries), queries
        if "vllm" in engine["image"]:
            assert any("quantroute_branch_remote_kv_usage_ratio" in q for q in queries)
            assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        else:  # llama-server exports no KV usage any more: the requests it defers
            assert "--metrics" in engine["args"]
            assert any("quantroute_branch_remote_waiting_requests" in q for q in queries)
    fp8 = _pod(_find("Deployment", "vllm-fp8"))["containers"][0]
    assert (_arg(fp8, "--quantization"), _arg(fp8, "--kv-cache-dtype")) == ("fp8", "fp8")
    awq = _pod(_find("Deployment", "vllm-awq"))["containers"][0]
    assert _arg(awq, "--quantization") == "awq_marlin"  # "awq" forces the slow kernel
    assert awq["args"][0] == "Qwen/Qwen2.5-1.5B-Instruct-AWQ"  # an AWQ checkpoint


def test_the_gateway_settings_load_with_the_pods_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantroute.config import load_settings
    from quantroute.resilience import load_tenants

    container = _pod(_find("Deployment", "quantroute"))["containers"][0]
    for name in [n for n in os.environ if n.startswith("QUANTROUTE_")]:
        monkeypatch.delenv(name)
    for var in container["env"]:  # the Secret's values stand in as their key names
        monkeypatch.setenv(var["name"], var.get("value", var["valueFrom"]["secretKeyRef"]["key"]))
    config = _arg(container, "--config")
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[config]["subPath"] == "config.yaml"
    settings = load_settings(K8S / "files" / "config.yaml")
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port == container["ports"][0]["containerPort"]
    assert settings.server.admin_key is not None and settings.server.metrics_key is not None
    assert settings.repo.as_posix() in mounts and mounts[settings.repo.as_posix()]["readOnly"]
    tenants = settings.auth.tenants_file
    assert tenants is not None and tenants.parent.as_posix() in mounts
    assert settings.engine.n_threads == int(container["resources"]["requests"]["cpu"])
    assert load_tenants(ROOT / "deploy" / "tenants.example.yaml").names() == ["default"]


def test_the_secret_the_pods_read_is_the_one_the_readme_creates() -> None:
    keys = set()
    for workload in _workloads(EVERYTHING):
        pod = _pod(workload)
        for c in pod["containers"]:
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("name") == SECRET:
                    keys.add(ref["key"])
        for volume in pod.get("volumes", []):
            if volume.get("secret", {}).get("secretName") == SECRET:
                keys.update(item["key"] for item in volume["secret"]["items"])
    assert keys == {"admin-key", "metrics-key", "engines-api-key", "tenants.yaml"}
    readme = (ROOT / "deploy" / "README.md").read_text()
    create = readme[readme.index(f"kubectl -n quantroute create secret generic {SECRET}") :]
    create = create[: create.index("```")]
    for key in keys:
        assert f"{key}=" in create, key
    monitor = _find("ServiceMonitor", "quantroute")
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": SECRET,
        "key": "metrics-key",
    }


def _run_fetch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    job = _pod(_find("Job", "fetch-model", _jobs()))["containers"][0]
    job_env = {e["name"]: e["value"] for e in job["env"]}
    job_env.update(
        MODEL_DIR=str(tmp_path / "repo" / "qwen2.5-1.5b-instruct"),
        MANIFEST_TEMPLATE=str(K8S / "files" / "model-manifest.yaml"),
        **env,
    )
    return subprocess.run(
        [sys.executable, str(K8S / "files" / "fetch_model.py")],
        env={"PATH": os.environ["PATH"], **job_env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_fetch_job_writes_a_model_the_repository_accepts(tmp_path: Path) -> None:
    """Its script, run as the Job runs it, on a GGUF at hand (file://): the file lands
    under the manifest's name, the manifest with its sha256, and the repository's own
    checks pass (the sha256, the GGUF header)."""
    from quantroute.engines.table import ENGINES
    from quantroute.registry.manifest import check_artifacts, load_manifest

    gguf = demo_model_dir() / "f16.gguf"
    done = _run_fetch(tmp_path, MODEL_URL=gguf.as_uri())
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "repo" / "qwen2.5-1.5b-instruct"
    manifest = load_manifest(folder, ENGINES)
    f16 = manifest.branches["f16"]
    assert f16.sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (folder / (f16.file or "")).read_bytes() == gguf.read_bytes()
    by_name = {a.name: a for a in check_artifacts(folder, manifest)}
    assert by_name["f16"].problem is None
    assert sorted(p.name for p in folder.iterdir()) == sorted([f16.file, "quantroute.yaml"])
    # a pinned digest the download does not have: nothing is kept
    again = _run_fetch(tmp_path / "b", MODEL_URL=gguf.as_uri(), MODEL_SHA256="0" * 64)
    assert again.returncode == 1
    assert list((tmp_path / "b" / "repo" / "qwen2.5-1.5b-instruct").iterdir()) == []


def _paths(routes: list[Any], prefix: str = "") -> set[str]:
    """Every path the app answers GET on, through its included routers."""
    found = set()
    for route in routes:
        if "GET" in (getattr(route, "methods", None) or ()):
            found.add(prefix + route.path)
        router = getattr(route, "original_router", None)  # FastAPI's included router
        if router is not None:
            found |= _paths(router.routes, prefix + route.include_context.prefix)
    return found


def test_the_probes_and_the_scrape_are_routes_of_the_app() -> None:
    routes = _paths(fake_app().routes)
    container = _pod(_find("Deployment", "quantroute"))["containers"][0]
    paths = {
        container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert paths == {"/healthz", "/readyz"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    scraped = {e["path"] for e in _find("ServiceMonitor", "quantroute")["spec"]["endpoints"]}
    assert paths | scraped <= routes, (paths | scraped) - routes


def test_the_prometheus_rule_carries_the_alert_rules_file() -> None:
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    groups = _find("PrometheusRule", "quantroute")["spec"]["groups"]
    assert groups[0] == alerts["groups"][0]
    assert [g["name"] for g in groups] == ["quantroute", "quantroute-kubernetes"]


def test_the_dockerfile_builds_as_the_project_does() -> None:
    """Read, not run: the project's own setup (make .venv: scripts/llama_build.sh, never
    -march=native), a non-root user that is the pods' runAsUser, a context that holds
    what the build copies."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    code = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in code
    assert any("make .venv" in line for line in code)
    assert not any("march=native" in line or "GGML_NATIVE=ON" in line for line in code)
    assert 'ENTRYPOINT ["quantroute"]' in code
    user = next(line.split()[1] for line in code if line.startswith("USER "))
    uid = int(user.split(":")[0])
    for workload in _workloads(BASE) + _jobs():
        if "quantroute" in _pod(workload)["containers"][0]["image"]:
            assert _pod(workload)["securityContext"]["runAsUser"] == uid
    make = (ROOT / "Makefile").read_text()
    assert "$(VENV):" in make and "scripts/llama_build.sh" in make  # what `make .venv` runs
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    kept = [line[1:] for line in ignore if line.startswith("!")]
    assert kept and all((ROOT / name).exists() for name in kept), kept

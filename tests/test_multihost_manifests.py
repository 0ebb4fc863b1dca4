"""The multi-host harness (tests/multihost/cluster.py) runs each role with the variables its Deployment in
deploy/kubernetes sets, the same values but for the token (a Secret there) and the SIZED ones (a 2-core test
machine), and resolves the same Service names and ports: so `make test-multihost` checks the wiring the
manifests rely on (docs/deployment.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.multihost.cluster import (BACKEND_GRPC, BACKENDS, BACKENDS_DNS, HOSTS, MANIFEST_ENV, MASTER_DNS,
                                     MASTER_PORT, SIZED, START_PORT)

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# The base and the pd-split overlay's own Deployments: plain manifests, read as they are (no kubectl needed).
FILES = [*sorted((KUBERNETES / "base").glob("*.yaml")), KUBERNETES / "overlays/pd-split/prefill.yaml",
         KUBERNETES / "overlays/pd-split/decode.yaml"]


def objects(kind: str) -> dict[str, dict[str, Any]]:
    docs = [d for f in FILES if f.name != "kustomization.yaml" for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def manifest_env(deployment: dict[str, Any]) -> dict[str, str | None]:
    """Its one container's variables; None for one taken from a Secret."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_harness_runs_every_deployment_with_its_variables() -> None:
    deployments = objects("Deployment")
    assert set(MANIFEST_ENV) == set(deployments)
    for name, deployment in deployments.items():
        ours, theirs = MANIFEST_ENV[name], manifest_env(deployment)
        assert set(ours) == set(theirs), name
        secret = {var for var, value in theirs.items() if value is None}
        assert secret == {"CLUSTER_TOKEN"}, name
        assert {v: ours[v] for v in theirs if v not in SIZED | secret} == \
            {v: theirs[v] for v in theirs if v not in SIZED | secret}, name
    assert set(HOSTS.values()) == set(MANIFEST_ENV)  # every Deployment has a host in the harness


def test_the_harness_resolves_the_manifests_service_names_and_ports() -> None:
    services = objects("Service")
    master = services[MASTER_DNS]
    assert [p["port"] for p in master["spec"]["ports"]] == [MASTER_PORT]
    backends = services[BACKENDS_DNS]
    assert backends["spec"]["clusterIP"] == "None"  # headless: one address per backend pod, as our hosts files
    assert {p["name"]: p["port"] for p in backends["spec"]["ports"]}["grpc"] == BACKEND_GRPC
    assert {p["port"] for p in services["kvyard"]["spec"]["ports"]} == {START_PORT}
    # Every backend Deployment is behind the headless name (its selector), as every backend host is in ours.
    selector = backends["spec"]["selector"]
    behind = {n for n, d in objects("Deployment").items()
              if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()}
    assert behind == {HOSTS[h] for h in BACKENDS}

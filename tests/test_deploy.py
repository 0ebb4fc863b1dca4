"""The Kubernetes manifests: every kvyard container reads the cluster token from the one Secret (never an
inline value), so the internal ports they open with HOST=0.0.0.0 refuse callers without it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                found += [(path.name, c) for c in doc["spec"]["template"]["spec"]["containers"]]
    return found


def test_every_manifest_takes_the_cluster_token_from_a_secret() -> None:
    assert {name for name, _ in containers()} == {"frontend.yaml", "pdfusion.yaml"}
    for name, container in containers():
        env = {e["name"]: e for e in container.get("env", [])}
        token = env.get("CLUSTER_TOKEN")
        assert token is not None and "value" not in token, (name, token)
        assert token["valueFrom"]["secretKeyRef"] == {"name": "kvyard-cluster-token", "key": "token"}, name
        assert "CLUSTER_TOKEN_FILE" not in env  # one of the two, not both

"""components/sagemaker-api as an operator includes it (an overlay in namespace
aws-hyperpod, rendered with `kubectl kustomize`): the Service the SageMaker client's fixed
address names (ai-toolkit-gossip-headless.aws-hyperpod, ClusterIP, internalTrafficPolicy
Local, port 9200 -> the DaemonSet's `sagemaker` port), every object valid against the
Kubernetes schemas, and the daemon's config listening there: the base's config plus
`[listen] sagemaker` only, so the two tomls cannot drift."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tierckptd.config import parse_config

from tests.support.deploy_files import KUBECTL, KUBERNETES

COMPONENT = KUBERNETES / "components" / "sagemaker-api"
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
POD_IP = "10.20.30.40"
OVERLAY = """apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: aws-hyperpod
resources: [../../base]
components: [../../components/sagemaker-api]
"""


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import subprocess

    assert KUBECTL is not None, "kubectl >= 1.27 is needed to render deploy/kubernetes"
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    overlay = tree / "overlays" / "hyperpod"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(OVERLAY)
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def test_service_is_the_clients_address_on_the_nodes_own_daemon(
    objects: list[dict[str, Any]],
) -> None:
    service = _one(objects, "Service", "ai-toolkit-gossip-headless")
    assert service["metadata"]["namespace"] == "aws-hyperpod"
    spec = service["spec"]
    assert spec["type"] == "ClusterIP" and "clusterIP" not in spec  # not headless
    assert spec["internalTrafficPolicy"] == "Local"
    assert spec["ports"] == [
        {"name": "sagemaker", "port": 9200, "targetPort": "sagemaker", "protocol": "TCP"}
    ]
    daemonset = _one(objects, "DaemonSet", "tierckptd")
    assert daemonset["metadata"]["namespace"] == "aws-hyperpod"
    assert spec["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    ports = {
        p["name"]: p["containerPort"]
        for p in daemonset["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["sagemaker"] == 9200 and "peer" in ports


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_daemon_listens_there_and_the_config_is_the_base_plus_that(
    objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _one(objects, "ConfigMap", "tierckptd-config")["data"]["tierckptd.toml"]
    monkeypatch.setenv("POD_IP", POD_IP)
    monkeypatch.setenv("TIERCKPT_NODE_ID", "gpu-node-1")
    config = parse_config(tomllib.loads(text))
    assert config.listen.sagemaker == f"{POD_IP}:9200"
    assert config.security.local_isolation == ""  # the two are refused together
    base = (KUBERNETES / "base" / "tierckptd.toml").read_text().splitlines()
    added = [line for line in text.splitlines() if line not in base]
    assert [line for line in added if not line.startswith("#")] == ['sagemaker = "${POD_IP}:9200"']
    assert all(line in text.splitlines() for line in base)


def test_the_component_is_documented(objects: list[dict[str, Any]]) -> None:
    doc = Path(__file__).parents[2] / "docs" / "seed-client.md"
    assert "components/sagemaker-api" in doc.read_text()
    assert "aws-hyperpod" in (COMPONENT / "kustomization.yaml").read_text()

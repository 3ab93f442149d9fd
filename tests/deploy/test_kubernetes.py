"""The Kubernetes packaging as an operator applies it: every Kustomize base and overlay
renders with `kubectl kustomize`; every object validates offline against the Kubernetes
schemas (kubernetes-validate, strict: an unknown or misspelt field fails); the Prometheus
Operator objects, whose CRDs those schemas lack, have the shape the operator needs; and
in every overlay the daemon stays secure as shipped (audit M10, C3) and finds its peers
through the headless Service with its identity from the downward API."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tierckpt
from tierckptd.config import Config, exposure_warnings, parse_config

from tests.support.certs import make_certs
from tests.support.deploy_files import (
    KUBERNETES,
    SECRET_FILES,
    kustomizations,
    promql_expressions,
    render,
)

# The oldest Kubernetes minor the manifests claim, and the newest the schemas know.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
MONITORING = "monitoring.coreos.com/v1"
CLUSTER_SCOPED = {"Namespace", "PriorityClass"}
KUSTOMIZATIONS = kustomizations()
NODE_NAME, ZONE, POD_IP = "gpu-node-17", "us-east-1a", "10.20.30.40"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered once; production's Secret from real PEM files."""
    workdir = tmp_path_factory.mktemp("k8s")
    certs_dir = tmp_path_factory.mktemp("certs")
    certs = make_certs(certs_dir, (NODE_NAME, "gpu-node-18"))
    secrets = {
        "token": os.urandom(32).hex().encode(),
        "tls.crt": Path(certs.node_a.cert).read_bytes(),
        "tls.key": Path(certs.node_a.key).read_bytes(),
        "ca.crt": Path(certs.ca).read_bytes(),
    }
    assert set(secrets) == set(SECRET_FILES)
    return {k: render(k, workdir, secrets) for k in KUSTOMIZATIONS}


def _kinds(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for obj in objects:
        assert obj["kind"] not in kinds, f"two {obj['kind']} objects: test expects one"
        kinds[obj["kind"]] = obj
    return kinds


def _config(objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Config:
    """The rendered ConfigMap's tierckptd.toml, parsed in the pod's environment."""
    monkeypatch.setenv("POD_IP", POD_IP)  # downward API status.podIP
    monkeypatch.setenv("TIERCKPT_NODE_ID", NODE_NAME)  # spec.nodeName
    monkeypatch.setenv("TIERCKPT_FAILURE_DOMAIN", ZONE)  # the zone label
    return parse_config(tomllib.loads(_kinds(objects)["ConfigMap"]["data"]["tierckptd.toml"]))


def test_the_base_and_every_overlay_are_found() -> None:
    assert {"base", "overlays/monitoring", "overlays/production"} <= set(KUSTOMIZATIONS)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objects = rendered[kustomization]
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Service", "DaemonSet"} <= {
        o["kind"] for o in objects
    }
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], name
        else:
            assert obj["metadata"].get("namespace") == "tierckpt", name
        if obj["apiVersion"] == MONITORING:
            continue  # CRDs: test_monitoring_objects_*
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kustomization}: {name} invalid for Kubernetes {version}: {exc}")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_config_is_valid_and_passes_the_insecure_peer_check(
    kustomization: str,
    rendered: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _config(rendered[kustomization], monkeypatch)
    assert config.listen.peer == "0.0.0.0:7070"  # legitimate: token and TLS below
    assert config.security.token_file and config.security.tls_cert and config.security.tls_key
    assert config.security.tls_ca and not config.security.allow_insecure_peers
    assert exposure_warnings(config) == []
    assert config.metrics.listen == f"{POD_IP}:9464"  # the pod IP, not 0.0.0.0
    # Unauthenticated there: no job names (hashed labels), bounded series (audit 3 L4, M6).
    assert config.metrics.hash_namespaces and 0 < config.metrics.namespace_series <= 100
    assert config.persistent.storage_options == {}  # no credentials in a ConfigMap


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_identity_comes_from_the_downward_api(
    kustomization: str,
    rendered: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered[kustomization]
    config = _config(objects, monkeypatch)
    assert (config.node.id, config.node.failure_domain) == (NODE_NAME, ZONE)
    (container,) = _kinds(objects)["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"][:3]}
    assert env == {
        "POD_IP": "status.podIP",
        "TIERCKPT_NODE_ID": "spec.nodeName",  # stable across pod replacements
        "TIERCKPT_FAILURE_DOMAIN": "metadata.labels['topology.kubernetes.io/zone']",
    }


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_membership_names_the_headless_service_of_the_daemons(
    kustomization: str,
    rendered: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered[kustomization]
    config = _config(objects, monkeypatch)
    kinds = _kinds(objects)
    service, daemonset = kinds["Service"], kinds["DaemonSet"]
    # A bare name: resolved through the pod's search path, in whatever namespace.
    assert config.membership.dns == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per daemon
    pod = daemonset["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["hostNetwork"] is True
    assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS on the host net
    (container,) = pod["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    peer_port = int(config.listen.peer.rpartition(":")[2])
    metrics_port = int(config.metrics.listen.rpartition(":")[2])
    assert config.membership.port in (0, peer_port)
    assert container_ports == {"peer": peer_port, "metrics": metrics_port}
    assert service_ports == {"peer": (peer_port, "peer"), "metrics": (metrics_port, "metrics")}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_secrets_are_mounted_where_the_config_points(
    kustomization: str,
    rendered: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered[kustomization]
    config = _config(objects, monkeypatch)
    pod = _kinds(objects)["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    assert secrets, "no Secret volume"
    for name, secret in secrets.items():
        assert secret["defaultMode"] == 0o400, (name, secret)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name in secrets:
        assert mounts[name].get("readOnly") is True
    secret_dirs = {mounts[name]["mountPath"]: secrets[name]["secretName"] for name in secrets}
    files = []
    for key in ("token_file", "tls_cert", "tls_key", "tls_ca"):
        directory, file = os.path.split(getattr(config.security, key))
        assert directory in secret_dirs, (key, directory, secret_dirs)
        files.append(file)
    assert sorted(files) == sorted(SECRET_FILES)
    assert pod["automountServiceAccountToken"] is False  # the daemon never calls the API


def test_only_the_production_overlay_holds_a_secret_and_its_files_stay_out_of_git(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for kustomization, objects in rendered.items():
        secrets = [o for o in objects if o["kind"] == "Secret"]
        if kustomization != "overlays/production":
            assert not secrets, f"{kustomization} ships a Secret's content: create it instead"
            continue
        (secret,) = secrets
        assert secret["metadata"]["name"] == "tierckptd-peer-auth"  # no hash: see comments
        assert set(secret["data"]) == set(SECRET_FILES)
        volumes = _kinds(objects)["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
        assert {"secretName": "tierckptd-peer-auth", "defaultMode": 0o400} in [
            v.get("secret") for v in volumes
        ]
    ignore = (KUBERNETES / "overlays" / "production" / "secrets" / ".gitignore").read_text()
    assert [line for line in ignore.splitlines() if not line.startswith("#")] == [
        "*",
        "!.gitignore",
    ]
    leftovers = set(os.listdir(KUBERNETES / "overlays" / "production" / "secrets"))
    assert leftovers <= {".gitignore", *SECRET_FILES}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_daemonset_runs_non_root_without_privileges(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    pod = _kinds(rendered[kustomization])["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0 and ctx["runAsGroup"] != 0
    assert ctx.get("privileged", False) is False
    assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    assert pod["securityContext"]["fsGroup"] == ctx["runAsGroup"]  # reads the 0400 Secret
    # The root init container may only chown/chmod the hostPath dirs to the daemon's ids.
    (init,) = pod["initContainers"]
    init_ctx = init["securityContext"]
    assert init_ctx.get("privileged", False) is False
    assert init_ctx["allowPrivilegeEscalation"] is False
    assert init_ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    script = " ".join(init["command"])
    assert f"{ctx['runAsUser']}:{ctx['runAsGroup']}" in script and "chmod 2750" in script
    # tmpfs pages the daemon writes (replicas, restored files) are charged to its cgroup:
    # a memory limit below [memory] budget would OOM-kill it.
    assert "memory" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_images_are_this_release(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    pod = _kinds(rendered[kustomization])["DaemonSet"]["spec"]["template"]["spec"]
    for container in pod["initContainers"] + pod["containers"]:
        assert container["image"] == f"tierckpt/tierckptd:{tierckpt.__version__}", container


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_probes_do_not_use_the_tls_peer_port(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    daemonset = _kinds(rendered[kustomization])["DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container[probe]
        assert "grpc" not in spec and "tcpSocket" not in spec, (probe, spec)
        assert spec["exec"]["command"][-1] == "--probe", (probe, spec)
        assert spec["timeoutSeconds"] >= 2, (probe, spec)


# --- Prometheus Operator objects (CRDs: no schema in kubernetes-validate) -----------------

_DURATION = re.compile(r"\d+(ms|s|m|h|d|w|y)")
_SEVERITIES = {"critical", "warning", "info"}


def _monitoring(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    objects = rendered["overlays/monitoring"]
    return [o for o in objects if o["apiVersion"] == MONITORING]


def test_monitoring_objects_are_in_every_overlay_that_includes_the_component(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for kustomization in ("overlays/monitoring", "overlays/production"):
        kinds = {o["kind"] for o in rendered[kustomization] if o["apiVersion"] == MONITORING}
        assert kinds == {"ServiceMonitor", "PrometheusRule"}, kustomization
    assert not [o for o in rendered["base"] if o["apiVersion"] == MONITORING]


def test_service_monitor_scrapes_the_daemons_metrics_port(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    kinds = _kinds(rendered["overlays/monitoring"])
    monitor, service = kinds["ServiceMonitor"], kinds["Service"]
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in service_ports and endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"
    assert _DURATION.fullmatch(endpoint["interval"]) and _DURATION.fullmatch(
        endpoint["scrapeTimeout"]
    )
    # The series' own `namespace` (the checkpoint namespace) must not become
    # `exported_namespace`: the alerts and the dashboard group by it.
    assert endpoint["honorLabels"] is True
    for relabel in endpoint["relabelings"]:
        assert set(relabel) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement"}


def _rules(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    (rule,) = [o for o in _monitoring(rendered) if o["kind"] == "PrometheusRule"]
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(rule["spec"]) == {"groups"}
    rules: list[dict[str, Any]] = []
    names = set()
    for group in rule["spec"]["groups"]:
        assert group["name"] not in names and group["rules"], group
        names.add(group["name"])
        rules.extend(group["rules"])
    return rules


def _balanced(expr: str) -> bool:
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for char in re.sub(r'"[^"]*"', '""', expr):  # brackets inside label values do not count
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def test_every_alert_has_expr_for_severity_and_annotations(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    rules = _rules(rendered)
    alerts = [r["alert"] for r in rules]
    assert len(alerts) == len(set(alerts)), alerts
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Tierckpt[A-Z][A-Za-z0-9]+", rule["alert"]), rule["alert"]
        assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule
        assert _balanced(rule["expr"]), (rule["alert"], rule["expr"])
        assert _DURATION.fullmatch(rule["for"]), rule
        assert rule["labels"]["severity"] in _SEVERITIES, rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule


def test_alerts_cover_rpo_drain_copies_budget_and_peers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    exprs = " ".join(r["expr"] for r in _rules(rendered))
    for needle in (
        'tierckpt_newest_checkpoint_timestamp_seconds{tier="durable"}',
        'tierckpt_newest_checkpoint_timestamp_seconds{tier="replicated"}',
        "tierckpt_drain_backlog_checkpoints",
        "tierckpt_drain_backlog_bytes",
        "tierckpt_under_replicated_checkpoints",
        "tierckpt_corrupt_copies_total",
        "tierckpt_memory_budget_bytes",
        "tierckpt_peer_up",
        "tierckpt_persistent_errors_total",
    ):
        assert needle in exprs, needle


def test_every_query_of_the_dashboard_and_the_alerts_is_balanced() -> None:
    for where, expr in promql_expressions().items():
        assert _balanced(expr), (where, expr)

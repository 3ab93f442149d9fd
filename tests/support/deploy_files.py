"""The shipped Kubernetes and Grafana files, rendered and read the way an operator uses them.

`render` runs `kubectl kustomize` (kustomize v5, built into kubectl) on a copy of
deploy/kubernetes, so that an overlay's secretGenerator can be given its files (generated
here, never committed) without touching the checkout. `referenced_metrics` lists every
tierckpt metric the PrometheusRule and the dashboard query, for the test that checks a
live daemon exports each of them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD",
    "KUBERNETES",
    "KUBECTL",
    "SECRET_FILES",
    "kustomizations",
    "load_dashboard",
    "promql_expressions",
    "referenced_metrics",
    "render",
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "tierckpt-dashboard.json"
KUBECTL = shutil.which("kubectl")
# The files overlays/production's secretGenerator reads from its secrets/ directory.
SECRET_FILES = ("token", "tls.crt", "tls.key", "ca.crt")
_METRIC = re.compile(r"\btierckpt_[a-z0-9_]+\b")


def kustomizations() -> list[str]:
    """Every directory under deploy/kubernetes that `kubectl kustomize` can render (the
    base and each overlay; components only take effect through an overlay)."""
    return sorted(
        str(path.parent.relative_to(KUBERNETES))
        for path in KUBERNETES.rglob("kustomization.yaml")
        if "kind: Component" not in path.read_text()
    )


def render(kustomization: str, workdir: Path, secrets: dict[str, bytes]) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize` renders for `kustomization` (relative to
    deploy/kubernetes), from a copy in `workdir` whose secrets/ dirs hold `secrets`."""
    if KUBECTL is None:
        raise AssertionError(
            "kubectl is not on PATH: install kubectl >= 1.27 (it embeds kustomize v5) "
            "to render deploy/kubernetes"
        )
    tree = workdir / "kubernetes"
    if not tree.exists():
        shutil.copytree(KUBERNETES, tree)
        for secrets_dir in tree.rglob("secrets"):
            for name, content in secrets.items():
                (secrets_dir / name).write_bytes(content)
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(tree / kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def load_dashboard() -> dict[str, Any]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard, dict)
    return dashboard


def _prometheus_rule() -> dict[str, Any]:
    path = KUBERNETES / "components" / "monitoring" / "prometheusrule.yaml"
    rule = yaml.safe_load(path.read_text())
    assert isinstance(rule, dict)
    return rule


def promql_expressions() -> dict[str, str]:
    """Where -> PromQL, for every alert expr and every dashboard query."""
    out: dict[str, str] = {}
    for group in _prometheus_rule()["spec"]["groups"]:
        for rule in group["rules"]:
            out[f"alert {rule['alert']}"] = rule["expr"]
    dashboard = load_dashboard()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            out[f"variable {variable['name']}"] = variable["query"]["query"]
    return out


def referenced_metrics() -> dict[str, set[str]]:
    """Metric (sample) name -> the alerts/panels that query it."""
    out: dict[str, set[str]] = {}
    for where, expr in promql_expressions().items():
        for name in _METRIC.findall(expr):
            out.setdefault(name, set()).add(where)
    return out

"""The Helm chart, rendered by the real helm (`helm template`) and asserted object by object.

helm is the binary e2e/build.sh builds (e2e/.work/bin/helm-<HELM_VERSION>/helm, or EMBER_E2E_HELM).
CI builds it before the tests run (.ci/run's go-build stage), so there a missing helm fails; on a
machine without it these tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from go_tools import built

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ember"
RULES = CHART / "monitoring" / "ember-rules.yaml"
DASHBOARD = CHART / "monitoring" / "ember-dashboard.json"
Docs = list[dict[str, Any]]


def _helm() -> str:
    env = os.environ.get("EMBER_E2E_HELM")
    if env:
        return env
    versions = dict(line.split("#")[0].strip().split("=", 1) for line in
                    (REPO / "e2e" / "versions.env").read_text().splitlines() if "=" in line.split("#")[0])
    work = Path(os.environ.get("EMBER_E2E_WORK", REPO / "e2e" / ".work"))
    path = work / "bin" / f"helm-{versions['HELM_VERSION']}" / "helm"
    if path.exists():
        return str(path)
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"helm not built at {path} (e2e/build.sh builds it before the tests)", pytrace=False)
    pytest.skip(f"helm not built ({path}; e2e/build.sh or EMBER_E2E_HELM)")


@pytest.fixture(scope="module")
def helm() -> str:
    return _helm()


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: str, *sets: str, kube_version: str = "1.35.0") -> Docs:
    args = ["template", "ember", str(CHART), "--namespace", "ember-system", "--kube-version", kube_version]
    for s in sets:
        args += ["--set", s]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: Docs, kind: str, pred: Callable[[dict[str, Any]], bool] = lambda _: True) -> Docs:
    return [d for d in docs if d["kind"] == kind and pred(d)]


def one(docs: Docs, kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, lambda d: name is None or d["metadata"]["name"] == name)
    assert len(found) == 1, f"{kind} {name}: {[d['metadata'].get('name') for d in found]}"
    return found[0]


def test_lint(helm: str) -> None:
    proc = run_helm(helm, "lint", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kube_version_is_at_least_1_30(helm: str) -> None:
    assert run_helm(helm, "template", "x", str(CHART), "--kube-version", "1.30.0").returncode == 0
    old = run_helm(helm, "template", "x", str(CHART), "--kube-version", "1.29.9")
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def test_crds_are_templates_equal_to_the_generated_ones(helm: str) -> None:
    docs = render(helm)
    rendered = {d["metadata"]["name"]: d for d in find(docs, "CustomResourceDefinition")}
    generated = {p.name.removesuffix(".yaml"): yaml.safe_load(p.read_text())
                 for p in (REPO / "crds").glob("*.yaml")}
    assert set(rendered) == set(generated) == {"modeldeployments.ember.dev", "grapharchives.ember.dev"}
    for name, crd in rendered.items():
        meta = crd["metadata"]
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert {**crd, "metadata": {"name": name}} == {**generated[name], "metadata": {"name": name}}
    assert not find(render(helm, "crds.install=false"), "CustomResourceDefinition")
    unkept = find(render(helm, "crds.keep=false"), "CustomResourceDefinition")
    assert unkept
    assert all("helm.sh/resource-policy" not in (d["metadata"].get("annotations") or {}) for d in unkept)


def test_chart_copy_of_the_crds_is_the_generated_source() -> None:
    ours = {p.name: p.read_text() for p in (CHART / "files" / "crds").glob("*.yaml")}
    assert ours == {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}
    assert not (CHART / "crds").exists(), "Helm never upgrades a chart's crds/ folder: use files/crds"


def test_pdb_covers_the_operator_replicas(helm: str) -> None:
    docs = render(helm)
    pdb, deploy = one(docs, "PodDisruptionBudget"), one(docs, "Deployment")
    assert pdb["spec"]["maxUnavailable"] == 1 and deploy["spec"]["replicas"] == 2
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert not find(render(helm, "operator.replicas=1"), "PodDisruptionBudget")


def _operator_env(docs: Docs) -> dict[str, Any]:
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_warm_pods_run_at_a_low_priority_class_of_the_chart(helm: str) -> None:
    docs = render(helm)
    warm = one(docs, "PriorityClass", "ember-warm")
    assert warm["value"] < 0 and warm["preemptionPolicy"] == "Never" and not warm["globalDefault"]
    env = _operator_env(docs)
    assert env["EMBER_OPERATOR_WARM_PRIORITY_CLASS"] == "ember-warm"
    assert env["EMBER_OPERATOR_SERVING_PRIORITY_CLASS"] == ""
    off = render(helm, "warmPods.priorityClass.name=", "servingPods.priorityClassName=high")
    assert not find(off, "PriorityClass", lambda d: d["metadata"]["name"] == "ember-warm")
    env = _operator_env(off)
    assert env["EMBER_OPERATOR_WARM_PRIORITY_CLASS"] == ""
    assert env["EMBER_OPERATOR_SERVING_PRIORITY_CLASS"] == "high"


def test_warm_back_off_reaches_the_operator_with_its_defaults(helm: str) -> None:
    from ember_operator.settings import Settings

    defaults = Settings.from_env(_operator_env(render(helm)))
    assert (defaults.warm_backoff_seconds, defaults.warm_backoff_max_seconds) == (
        Settings.model_fields["warm_backoff_seconds"].default,
        Settings.model_fields["warm_backoff_max_seconds"].default)
    env = _operator_env(render(helm, "warmPods.backoffSeconds=2.5", "warmPods.backoffMaxSeconds=0"))
    assert env["EMBER_OPERATOR_WARM_BACKOFF_SECONDS"] == "2.5"
    assert env["EMBER_OPERATOR_WARM_BACKOFF_MAX_SECONDS"] == "0"
    settings = Settings.from_env(env)
    assert (settings.warm_backoff_seconds, settings.warm_backoff_max_seconds) == (2.5, 0.0)


def test_static_limits_are_written_into_the_admission_policy(helm: str) -> None:
    docs = render(helm, "limits.maxReplicas=30", "limits.maxNamespaceWarmGpus=12")
    policy = one(docs, "ValidatingAdmissionPolicy", "ember-limits")
    limits = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert (limits["maxReplicas"], limits["maxWarmGpus"], limits["maxGpusPerPod"]) == ("30", "64", "0")
    assert "modeldeployments/scale" in policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "ember-limits")
    selector = binding["spec"]["matchResources"]["namespaceSelector"]
    assert selector["matchExpressions"][0]["values"] == ["default"]
    assert _operator_env(docs)["EMBER_OPERATOR_MAX_NAMESPACE_WARM_GPUS"] == "12"
    off = render(helm, "limits.admission=false")
    assert not find(off, "ValidatingAdmissionPolicy", lambda d: "limits" in d["metadata"]["name"])


def _grants_secrets(role: dict[str, Any]) -> bool:
    return any("secrets" in r.get("resources", []) for r in role["rules"])


def test_secrets_are_read_only_where_pods_run(helm: str) -> None:
    docs = render(helm, "operator.namespaces={team-a,team-b}")
    assert not _grants_secrets(one(docs, "ClusterRole"))
    roles = find(docs, "Role", _grants_secrets)
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["default", "team-a", "team-b"]
    for role in roles:
        assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
        binding = one([d for d in docs if d["metadata"].get("namespace") == role["metadata"]["namespace"]],
                      "RoleBinding", role["metadata"]["name"])
        sa = {"kind": "ServiceAccount", "name": "ember", "namespace": "ember-system"}
        assert binding["subjects"] == [sa]
    cluster = render(helm, "rbac.secretsAccess=cluster")
    assert _grants_secrets(one(cluster, "ClusterRole")) and not find(cluster, "Role", _grants_secrets)
    bad = run_helm(helm, "template", "x", str(CHART), "--set", "rbac.secretsAccess=everywhere")
    assert bad.returncode != 0 and "secretsAccess" in bad.stderr


def test_pod_service_accounts_where_pods_run(helm: str) -> None:
    docs = render(helm, "workloadNamespaces={serving}", "operator.namespaces={team-a,serving}",
                  "podServiceAccountAnnotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::1:role/ember")
    accounts = find(docs, "ServiceAccount", lambda d: d["metadata"]["name"] == "ember-pod")
    assert sorted(a["metadata"]["namespace"] for a in accounts) == ["serving", "team-a"]
    assert all(a["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/ember"}
               for a in accounts)
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "ember-pod-self-only")
    values = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"]
    assert sorted(values) == ["serving", "team-a"]


def test_monitoring_objects_are_off_by_default(helm: str) -> None:
    kinds = {d["kind"] for d in render(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


def test_monitoring_objects_with_selectable_labels(helm: str) -> None:
    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true",
                  "metrics.prometheusRule.enabled=true", "metrics.grafanaDashboard.enabled=true",
                  "metrics.extraLabels.release=kps", "metrics.podMonitor.labels.team=ml",
                  "workloadNamespaces={serving}")
    monitors = [one(docs, "ServiceMonitor"), *find(docs, "PodMonitor"), one(docs, "PrometheusRule")]
    assert len(monitors) == 4
    assert all(m["metadata"]["labels"]["release"] == "kps" for m in monitors)
    service_monitor = one(docs, "ServiceMonitor")
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    pods = {m["metadata"]["name"]: m for m in find(docs, "PodMonitor")}
    sidecar, engine = pods["ember-sidecar"], pods["ember-engine"]
    assert sidecar["metadata"]["labels"]["team"] == "ml"
    assert sidecar["spec"]["namespaceSelector"]["matchNames"] == ["serving"]
    assert sidecar["spec"]["podMetricsEndpoints"][0]["port"] == "ember-sidecar"
    assert engine["spec"]["podMetricsEndpoints"][0]["targetPort"] == 8000
    assert engine["spec"]["selector"]["matchLabels"]["ember.dev/pool"] == "serving"
    rule = one(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["ember.json"]) == json.loads(DASHBOARD.read_text())
    only_engine_off = render(helm, "metrics.podMonitor.enabled=true", "metrics.podMonitor.engine=false")
    assert [m["metadata"]["name"] for m in find(only_engine_off, "PodMonitor")] == ["ember-sidecar"]


def test_rendered_prometheus_rule_passes_promtool(helm: str, tmp_path: Path) -> None:
    """What the Prometheus Operator loads: the rendered PrometheusRule's groups, as a rule file."""
    promtool = built("promtool", "PROMETHEUS_VERSION", "EMBER_PROMTOOL")
    rule = one(render(helm, "metrics.prometheusRule.enabled=true"), "PrometheusRule")
    path = tmp_path / "rendered-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""The operator's identity in the k8s tests: the admin kubeconfig, or the Helm chart's ServiceAccount.

With `EMBER_TEST_OPERATOR_KUBECONFIG=sa` every operator the tests start (operator_harness.operator_env)
runs with a kubeconfig that holds ONLY a token of the chart's ServiceAccount: the chart's RBAC
(templates/serviceaccount.yaml + templates/rbac.yaml, rendered by the helm binary e2e/build.sh
made) is applied to the local control plane, a token is minted through the TokenRequest API and
written into a kubeconfig without client certificates. A verb the chart lacks then shows up as a
403 in the operator's log, which `assert_no_forbidden` turns into a test failure (most scenarios
would otherwise only time out, or pass while an event or a cleanup silently failed).

Any other non-empty value is used as a kubeconfig path as-is.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support.cluster import ENV_FILE, REPO, LocalCluster, read_env_file

ENV_VAR = "EMBER_TEST_OPERATOR_KUBECONFIG"
CHART = REPO / "charts" / "ember"
RELEASE = "ember-rbac-test"
RELEASE_NS = "ember-rbac-test"
# An RBAC denial as the API server words it (kopf, the kubernetes client and ember_operator.kube log
# the message): `... is forbidden: User "system:serviceaccount:ns:sa" cannot create resource ...`.
# Other 403s (a ResourceQuota, an admission webhook) are the API server's answer, not RBAC's.
FORBIDDEN = re.compile(r'forbidden: User "[^"]*" cannot ', re.IGNORECASE)

_cache: dict[str, Path] = {}


def mode() -> str:
    return os.environ.get(ENV_VAR, "").strip()


def render(templates: list[str], release: str = RELEASE, namespace: str = RELEASE_NS,
           sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`helm template` of the chart, only `templates` (e.g. "templates/rbac.yaml"), as objects."""
    helm = read_env_file(ENV_FILE)["EMBER_E2E_HELM"]
    args = [helm, "template", release, str(CHART), "--namespace", namespace]
    for t in templates:
        args += ["--show-only", t]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_rbac(release: str = RELEASE, namespace: str = RELEASE_NS) -> list[dict[str, Any]]:
    """The operator's ServiceAccount, ClusterRole(Binding) and Lease Role(Binding), as a
    namespace-scoped install renders them (the tests' operators watch one namespace each). The
    tests' namespaces are made per test, after this is applied: Secrets are read through the
    ClusterRole (`rbac.secretsAccess=cluster`); the namespaced Roles are tested in test_chart_rbac."""
    return render(["templates/serviceaccount.yaml", "templates/rbac.yaml"], release, namespace,
                  sets=("operator.namespaces={ember-test}", "rbac.secretsAccess=cluster"))


def apply_docs(k8s: LocalCluster, docs: list[dict[str, Any]]) -> None:
    proc = subprocess.run(
        [str(k8s.kubectl_path), "--kubeconfig", str(k8s.kubeconfig), "apply", "--server-side",
         "--force-conflicts", "-f", "-"],
        input=yaml.safe_dump_all(docs), capture_output=True, text=True, timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl apply of the chart's RBAC failed: {proc.stderr}")


def install(k8s: LocalCluster, docs: list[dict[str, Any]], namespace: str) -> str:
    """Apply a namespace and the RBAC docs; the SA's name."""
    core = client.CoreV1Api(k8s.api_client)
    if not core.list_namespace(field_selector=f"metadata.name={namespace}").items:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    apply_docs(k8s, docs)
    return next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")


def token_kubeconfig(k8s: LocalCluster, sa: str, namespace: str, path: Path,
                     bound_pod: Any = None) -> Path:
    """A kubeconfig whose only credential is a TokenRequest token of `sa` (server, CA from the admin one);
    with `bound_pod` (a V1Pod) the token is bound to that pod, like a projected SA token volume."""
    bound = None if bound_pod is None else client.V1BoundObjectReference(
        api_version="v1", kind="Pod", name=bound_pod.metadata.name, uid=bound_pod.metadata.uid)
    req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=["https://kubernetes.default.svc.cluster.local"], expiration_seconds=24 * 3600,
        bound_object_ref=bound))
    core = client.CoreV1Api(k8s.api_client)
    token = core.create_namespaced_service_account_token(sa, namespace, req).status.token
    admin = yaml.safe_load(k8s.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "ember-local", "cluster": {
            "server": cluster["server"],
            "certificate-authority-data": cluster["certificate-authority-data"]}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "ember-local", "user": sa}}],
        "current-context": sa,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def chart_sa_kubeconfig(k8s: LocalCluster) -> Path:
    """Install the chart's RBAC once per session and return the SA-token kubeconfig."""
    if "sa" not in _cache:
        sa = install(k8s, render_rbac(), RELEASE_NS)
        path = ENV_FILE.parent / "run" / f"{RELEASE}.kubeconfig"
        _cache["sa"] = token_kubeconfig(k8s, sa, RELEASE_NS, path)
    return _cache["sa"]


def operator_kubeconfig(k8s: LocalCluster) -> Path:
    """The kubeconfig an operator under test runs with (see the module docstring)."""
    value = mode()
    if not value:
        return k8s.kubeconfig
    if value == "sa":
        return chart_sa_kubeconfig(k8s)
    return Path(value)


def forbidden_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if FORBIDDEN.search(line)]


def assert_no_forbidden(log_path: Path) -> None:
    """Fail the test when the operator (running as a restricted identity) was refused anything."""
    try:
        lines = forbidden_lines(log_path.read_text(errors="replace"))
    except OSError:
        return
    if lines:
        pytest.fail("the operator was refused by RBAC (the chart lacks a permission):\n"
                    + "\n".join(lines[:20]), pytrace=False)

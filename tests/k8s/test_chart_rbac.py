"""The chart's least-privilege Secret access on the real apiserver: with the default
`rbac.secretsAccess: namespaced` the operator's ServiceAccount may `get` Secrets in the workload
namespaces only (a Role each), never list them, never elsewhere; `cluster` grants `get` everywhere.
Tokens are real TokenRequest tokens of the rendered ServiceAccount; `kubectl auth can-i` asks."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from sa_identity import apply_docs, install, render, token_kubeconfig
from support.cluster import LocalCluster

pytestmark = pytest.mark.k8s


def can_i(k8s: LocalCluster, kubeconfig: Path, *args: str) -> bool:
    proc = subprocess.run([str(k8s.kubectl_path), "--kubeconfig", str(kubeconfig), "auth", "can-i", *args],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() == "yes"


def test_operator_reads_secrets_only_in_workload_namespaces(k8s: LocalCluster, tmp_path: Path) -> None:
    workload, other = k8s.create_namespace("secrets-in"), k8s.create_namespace("secrets-out")
    release = f"sec-{uuid.uuid4().hex[:6]}"
    home = k8s.create_namespace("secrets-home")
    docs = render(["templates/serviceaccount.yaml", "templates/rbac.yaml", "templates/secrets-rbac.yaml"],
                  release, home, sets=(f"workloadNamespaces={{{workload}}}",))
    sa = install(k8s, docs, home)
    kubeconfig = token_kubeconfig(k8s, sa, home, tmp_path / "sa.kubeconfig")
    assert can_i(k8s, kubeconfig, "get", "secrets/ember-s3", "-n", workload)
    assert not can_i(k8s, kubeconfig, "list", "secrets", "-n", workload)
    assert not can_i(k8s, kubeconfig, "get", "secrets/ember-s3", "-n", other)
    assert not can_i(k8s, kubeconfig, "get", "secrets/ember-s3", "-n", home)

    cluster_wide = render(["templates/rbac.yaml"], release, home,
                          sets=(f"workloadNamespaces={{{workload}}}", "rbac.secretsAccess=cluster"))
    apply_docs(k8s, cluster_wide)
    assert can_i(k8s, kubeconfig, "get", "secrets/ember-s3", "-n", other)
    for doc in docs + cluster_wide:  # cluster-scoped leftovers (the namespaces go with the session)
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            k8s.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found",
                        check=False)

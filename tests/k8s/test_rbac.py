"""The operator runs with the Helm chart's RBAC only: its ServiceAccount's token, no admin certificate.

Every run of this module: the chart's ServiceAccount/ClusterRole/binding are applied (helm template,
the helm binary e2e/build.sh made), a TokenRequest token goes into a kubeconfig with no other
credential, and one full scenario (SAVE Job → archive Available → serving pods Ready → delete →
finalizer cleanup → GraphArchive and SAVE Job garbage-collected) runs on it; any 403 in the
operator's log fails the test. A ClusterRole missing one verb is shown to fail the same way.

The whole operator suite runs as that identity with `EMBER_TEST_OPERATOR_KUBECONFIG=sa`
(tests/k8s/sa_identity.py; .ci/run has the stage):
    EMBER_TEST_OPERATOR_KUBECONFIG=sa flock /tmp/ember-k8s.lock python -m pytest tests/k8s/test_operator*.py
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
from operator_harness import identity_of, md_spec, operator_env, phase, wait_for, write_test_archive
from sa_identity import (
    assert_no_forbidden,
    chart_sa_kubeconfig,
    forbidden_lines,
    install,
    render_rbac,
    token_kubeconfig,
)
from support.cluster import LocalCluster, LocalMinio

pytestmark = [pytest.mark.k8s, pytest.mark.s3, pytest.mark.slow]

BROKEN = "ember-rbac-broken"


def can_i(k8s: LocalCluster, kubeconfig: Path, *args: str) -> bool:
    proc = subprocess.run([str(k8s.kubectl_path), "--kubeconfig", str(kubeconfig), "auth", "can-i", *args],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() == "yes"


def test_token_kubeconfig_holds_only_the_chart_identity(k8s: LocalCluster, crds: None) -> None:
    kubeconfig = chart_sa_kubeconfig(k8s)
    text = kubeconfig.read_text()
    assert "client-certificate" not in text and "client-key" not in text
    who = subprocess.run([str(k8s.kubectl_path), "--kubeconfig", str(kubeconfig), "auth", "whoami", "-o",
                          "jsonpath={.status.userInfo.username}"], capture_output=True, text=True, timeout=60)
    assert who.stdout == "system:serviceaccount:ember-rbac-test:ember-rbac-test", who.stderr
    assert can_i(k8s, kubeconfig, "create", "jobs.batch", "-n", "default")
    assert can_i(k8s, kubeconfig, "patch", "modeldeployments.ember.dev/status", "-n", "default")
    for denied in (("create", "deployments.apps"), ("delete", "nodes"), ("update", "pods"),
                   ("create", "secrets"), ("patch", "customresourcedefinitions"), ("delete", "namespaces")):
        assert not can_i(k8s, kubeconfig, *denied, "-n", "default"), denied


def test_full_scenario_as_the_chart_service_account(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    kubeconfig = chart_sa_kubeconfig(k8s)
    env = {"EMBER_OPERATOR_ARCHIVE_RETENTION_SECONDS": "3"}
    with operator_env(k8s, minio, tmp_path, "rbac", env, kubeconfig=kubeconfig) as (api, op, prefix):
        spec = md_spec(minio, prefix, replicas=2, autoscaling={"minReplicas": 2, "maxReplicas": 3},
                       warmPool={"size": 1},
                       save={"podAnnotations": {"pod-complete.stage.kwok.x-k8s.io/delay": "3s"}})
        api.create_md("sa", spec)
        wait_for(lambda: api.jobs(), "the SAVE Job", op)
        wait_for(lambda: phase(api, "sa") == "Saving", "Saving", op)
        write_test_archive(minio, prefix, spec)
        wait_for(lambda: phase(api, "sa") == "Ready", "Ready", op, timeout=90)
        wait_for(lambda: api.hpa.list_namespaced_horizontal_pod_autoscaler(api.ns).items, "the HPA", op)
        # the events are posted after the status that says Ready: wait for them too
        wait_for(lambda: {e["reason"] for e in api.events_for("sa")} >= {"Phase", "ArchiveAvailable"},
                 "the Phase and ArchiveAvailable events", op)
        assert len(api.archives()) == 1 and identity_of(spec)
        api.delete_md("sa")
        wait_for(lambda: not api.serving("sa"), "pods cleaned up by the finalizer", op)
        wait_for(lambda: not api.archives() and not api.jobs(), "GraphArchive and SAVE Job collected", op,
                 timeout=60)
        assert not forbidden_lines(op.log_path.read_text())


def _without_verb(docs: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    docs = copy.deepcopy(docs)
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        if resource in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return docs


def test_a_verb_the_chart_lacks_fails_the_test(
    k8s: LocalCluster, minio: LocalMinio, crds: None, tmp_path: Path,
) -> None:
    """The chart's ClusterRole without `create` on jobs: the operator is refused (403), and the
    harness's check turns that into a failure (rather than a timeout, or a pass)."""
    docs = _without_verb(render_rbac(BROKEN, BROKEN), "jobs", "create")
    sa = install(k8s, docs, BROKEN)
    kubeconfig = token_kubeconfig(k8s, sa, BROKEN, tmp_path / "broken.kubeconfig")
    refused = pytest.raises(pytest.fail.Exception, match="refused by RBAC")
    with refused, operator_env(k8s, minio, tmp_path, "rbacx", kubeconfig=kubeconfig) as (api, op, prefix):
        api.create_md("x", md_spec(minio, prefix))
        wait_for(lambda: any("jobs" in line for line in forbidden_lines(op.log_path.read_text())),
                 "a 403 on creating the SAVE Job", op)
        assert not api.jobs()
    with pytest.raises(pytest.fail.Exception):
        assert_no_forbidden(tmp_path / "operator.log")
    k8s.kubectl("delete", f"clusterrolebinding/{BROKEN}", f"clusterrole/{BROKEN}", "--ignore-not-found")

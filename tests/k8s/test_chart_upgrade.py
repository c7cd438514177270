"""`helm install` of the previous chart (CRDs in its crds/ folder), a live ModelDeployment, then
`helm upgrade` to this chart (CRDs as templates, adopted as docs/install.md says) and
`helm uninstall` (the CRDs and the ModelDeployment stay), on the real local apiserver with the
helm e2e/build.sh built. The operator's pods only "run" here (kwok); what is tested is Helm's
handling of the objects."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from support.cluster import ENV_FILE, REPO, LocalCluster, read_env_file

pytestmark = pytest.mark.k8s

PREVIOUS = "e4c89e9"  # the last commit whose chart shipped its CRDs in charts/ember/crds/
CRDS = ("modeldeployments.ember.dev", "grapharchives.ember.dev")


def previous_chart(dest: Path) -> Path:
    """charts/ember as of PREVIOUS, from git. A clone without that history (shallow) gets this
    chart laid out the previous way instead: its CRDs in crds/, no CRD templates."""
    out = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS, "charts/ember"],
                         capture_output=True, timeout=60)
    if out.returncode == 0:
        subprocess.run(["tar", "-x", "-C", str(dest)], input=out.stdout, check=True, timeout=60)
        return dest / "charts" / "ember"
    print(f"commit {PREVIOUS} not in this clone: the current chart with its CRDs in crds/ stands in")
    chart = dest / "ember"
    shutil.copytree(REPO / "charts" / "ember", chart)
    (chart / "files" / "crds").rename(chart / "crds")
    (chart / "templates" / "crds.yaml").unlink()
    return chart


def test_upgrade_from_the_previous_chart_and_uninstall(k8s: LocalCluster, crds: None, tmp_path: Path) -> None:
    helm = read_env_file(ENV_FILE)["EMBER_E2E_HELM"]
    ns, workload = k8s.create_namespace("helm-home"), k8s.create_namespace("helm-work")
    release = f"up-{uuid.uuid4().hex[:6]}"
    env = {"KUBECONFIG": str(k8s.kubeconfig), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
           "HELM_CACHE_HOME": str(tmp_path / "cache"), "HELM_CONFIG_HOME": str(tmp_path / "config"),
           "HELM_DATA_HOME": str(tmp_path / "data")}
    sets = ["--set", f"workloadNamespaces={{{workload}}}", "--set", "presave.priorityClass.create=false",
            "--set", f"leaderElection.leaseName={release}"]

    def run_helm(*args: str) -> str:
        proc = subprocess.run([helm, *args, "--namespace", ns], capture_output=True, text=True, env=env,
                              timeout=180)
        assert proc.returncode == 0, f"helm {' '.join(args[:2])}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    # The cluster's CRDs are there already (the suite applied this tree's, as the previous chart's
    # crds/ folder would have on a real cluster): Helm 4 would server-side apply the previous
    # chart's older copies over them and conflict with kubectl's fields, so they are left as they are.
    run_helm("install", release, str(previous_chart(tmp_path)), "--skip-crds", *sets)
    md = {"apiVersion": "ember.dev/v1alpha1", "kind": "ModelDeployment",
          "metadata": {"name": "live", "namespace": workload},
          "spec": {"model": {"name": "Qwen/Qwen3-0.6B"},
                   "engine": {"kind": "vllm", "version": "0.26.0", "image": "registry.invalid/e:1"},
                   "capture": {"sizes": [1, 2], "maxBatch": 2, "maxNumTokens": 64},
                   "gpu": {"product": "NVIDIA-H100-80GB-HBM3"}, "replicas": 0,
                   "store": {"s3": {"bucket": "ember-test"}}}}
    manifest = tmp_path / "md.yaml"
    manifest.write_text(yaml.safe_dump(md))
    k8s.kubectl("apply", "-f", str(manifest))

    # docs/install.md, "Upgrade": adopt the CRDs the previous chart's crds/ folder (or kubectl) made.
    for crd in CRDS:
        k8s.kubectl("label", "crd", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        k8s.kubectl("annotate", "crd", crd, f"meta.helm.sh/release-name={release}",
                    f"meta.helm.sh/release-namespace={ns}", "--overwrite")
    run_helm("upgrade", release, str(REPO / "charts" / "ember"), *sets)
    for crd in CRDS:
        meta = yaml.safe_load(k8s.kubectl("get", "crd", crd, "-o", "yaml").stdout)["metadata"]
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep", crd
    pdb = k8s.kubectl("get", "pdb", "-n", ns, "-o", "name").stdout
    assert pdb.strip(), "the upgrade adds the operator's PodDisruptionBudget"
    assert k8s.kubectl("get", "role", "-n", workload, "-o", "name").stdout.count("secrets") == 1
    assert k8s.kubectl("get", "md", "live", "-n", workload, "-o", "name").stdout.strip()

    run_helm("uninstall", release)
    for crd in CRDS:  # kept: every ModelDeployment of the cluster would go with them
        assert k8s.kubectl("get", "crd", crd, check=False).returncode == 0, crd
    assert k8s.kubectl("get", "md", "live", "-n", workload, "-o", "name").stdout.strip()
    assert k8s.kubectl("get", "deploy", "-n", ns, "-o", "name").stdout.strip() == ""
    k8s.kubectl("delete", "-f", str(manifest), "--ignore-not-found")

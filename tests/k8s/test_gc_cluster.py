"""`ember gc` reading the kept set from the real local apiserver: an archive whose identity a
ModelDeployment names (its `ember.dev/identity` label) stays, the other goes; what is shared stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.cluster import LocalCluster
from typer.testing import CliRunner

from ember import contract
from ember.archive import bundle
from ember.cli import app
from ember.identity import ArchiveIdentity, CompatKey
from ember.store import LocalStore
from ember_testing.synthetic import synthetic_graphset, synthetic_images

pytestmark = pytest.mark.k8s

A = ArchiveIdentity(model="test/gc-a", engine="vllm", engine_version="0.26.0", capture_sizes=(1, 2))
B = A.model_copy(update={"model": "test/gc-b"})
COMPAT = CompatKey(gpu_name="NVIDIA H100", compute_capability="9.0", driver="580.1", cuda="13.0")


def test_gc_keeps_what_the_cluster_names(k8s: LocalCluster, crds: None, k8s_namespace: str,
                                         tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    for identity in (A, B):
        bundle.write_archive(store, synthetic_graphset(graphs=2, nodes=30, groups=1), identity, COMPAT,
                             kernel_images=synthetic_images())
    md = {"apiVersion": contract.API_VERSION, "kind": contract.KIND_MODEL_DEPLOYMENT,
          "metadata": {"name": "gc-user", "namespace": k8s_namespace,
                       "labels": {contract.LABEL_IDENTITY: A.hash()[:16]}},
          "spec": {"model": {"name": "test/gc-a"},
                   "engine": {"kind": "vllm", "version": "0.26.0", "image": "registry.invalid/e:1"},
                   "capture": {"sizes": [1, 2], "maxBatch": 2, "maxNumTokens": 64},
                   "gpu": {"product": "NVIDIA-H100-80GB-HBM3"}, "replicas": 0,
                   "store": {"s3": {"bucket": "ember-test"}}}}
    manifest = tmp_path / "md.yaml"
    manifest.write_text(yaml.safe_dump(md))
    k8s.kubectl("apply", "-f", str(manifest))
    args = ["gc", store.uri, "--kubeconfig", str(k8s.kubeconfig), "--min-age", "0"]
    dry = CliRunner().invoke(app, [*args, "--json"])
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.output)
    assert plan["archives"] == [B.hash()] and plan["kept"] == [A.hash()]
    assert "the cluster" in plan["kept_from"]
    done = CliRunner().invoke(app, [*args, "--delete"])
    assert done.exit_code == 0, done.output
    assert store.list_archives() == [A.hash()]
    assert bundle.verify_archive(store, A.hash(), A) == []

#!/usr/bin/env bash
# README's first command: install ember, start the local control plane + MinIO, run the
# operator (when it exists) against it and apply examples/. Safe to rerun.
#
#   e2e/demo.sh            install + cluster + operator + examples
#   e2e/demo.sh --no-install
#
# Stop everything with `e2e/cluster.sh down` (it also stops the operator started here).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="${EMBER_E2E_WORK:-$ROOT/e2e/.work}"
log() { printf '[demo %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ "${1:-}" != "--no-install" ]]; then
  log "installing ember into .venv (editable, extras dev,operator,sidecar)"
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev,operator,sidecar]'
fi
# shellcheck disable=SC1091
source .venv/bin/activate

log "starting the local control plane and MinIO (first run builds them from Go sources)"
e2e/cluster.sh up
# shellcheck disable=SC1091
source "$WORK/env"
kubectl() { "$EMBER_E2E_KUBECTL" "$@"; }

# apply_dir DIR [ARGS...]: apply every Kubernetes manifest (YAML with apiVersion + kind) under DIR.
apply_dir() {
  local dir="$1" f found=0; shift
  while IFS= read -r -d '' f; do
    grep -q '^apiVersion:' "$f" && grep -q '^kind:' "$f" || continue
    kubectl apply "$@" -f "$f"
    found=1
  done < <(find "$dir" -type f \( -name '*.yaml' -o -name '*.yml' \) -print0 2>/dev/null | sort -z)
  ((found)) || log "no manifests in $dir yet"
}

apply_dir crds
for crd in $(kubectl get crd -o name | grep 'ember.dev$' || true); do
  kubectl wait --for condition=Established --timeout=60s "$crd" >/dev/null
done

# The operator runs on this machine against the local cluster (not in it: no image registry).
export EMBER_STORE="${EMBER_STORE:-s3://$EMBER_S3_BUCKET/ember}"
# Operator settings (EMBER_OPERATOR_*, see operator/ember_operator/settings.py); override freely.
# The demo's operator owns the examples' namespace only: e2e/test.sh's operators each own their
# own test namespace, so both can run at once without reconciling each other's objects. It still
# takes the leader Lease (in that namespace): a second demo operator would stand by, not fight.
DEMO_NAMESPACE="${EMBER_DEMO_NAMESPACE:-default}"
export EMBER_OPERATOR_NAMESPACES="${EMBER_OPERATOR_NAMESPACES:-$DEMO_NAMESPACE}"
export EMBER_OPERATOR_STANDALONE="${EMBER_OPERATOR_STANDALONE:-false}"
export EMBER_OPERATOR_DEFAULT_STORE="${EMBER_OPERATOR_DEFAULT_STORE:-$EMBER_STORE}"
export EMBER_OPERATOR_DEFAULT_S3_ENDPOINT="${EMBER_OPERATOR_DEFAULT_S3_ENDPOINT:-$EMBER_S3_ENDPOINT}"
export EMBER_OPERATOR_METRICS_PORT="${EMBER_OPERATOR_METRICS_PORT:-18080}"
# examples/modeldeployment-local.yaml stores under /tmp/ember-archives (a local demo).
export EMBER_OPERATOR_LOCAL_STORE_ROOT="${EMBER_OPERATOR_LOCAL_STORE_ROOT:-/tmp/ember-archives}"
export EMBER_OPERATOR_METRICS_HOST="${EMBER_OPERATOR_METRICS_HOST:-127.0.0.1}"  # a local demo: loopback only
if [[ -f operator/ember_operator/main.py ]]; then
  pidfile="$WORK/run/pids/operator.pid"
  if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    log "operator already running (pid $(cat "$pidfile"))"
  else
    mkdir -p "$WORK/run/logs" "$WORK/run/pids"
    setsid ember-operator >>"$WORK/run/logs/operator.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    log "operator started (pid $!, log $WORK/run/logs/operator.log, store $EMBER_STORE)"
    sleep 3
    kill -0 "$(cat "$pidfile")" 2>/dev/null || { tail -n 30 "$WORK/run/logs/operator.log" >&2; exit 1; }
  fi
else
  log "operator/ember_operator/main.py does not exist yet: skipping the operator"
fi

# ---- operator section (owned by the operator engineer: docs/operator.md) ----------------------
# Credentials Secret the S3 examples name (MinIO's keys from the cluster env).
kubectl create namespace "$DEMO_NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$DEMO_NAMESPACE" create secret generic ember-s3 --from-literal=AWS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
  --from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" --dry-run=client -o yaml | kubectl -n "$DEMO_NAMESPACE" apply -f -
# ---- end of operator section -------------------------------------------------------------------

apply_dir examples -n "$DEMO_NAMESPACE"

# ---- operator section (owned by the operator engineer) -----------------------------------------
# kwok nodes have no GPUs: a SAVE Job pod only "completes". Stand in for `ember save --job` by
# writing a small synthetic archive for every GraphArchive still saving, the way SAVE would
# (blobs, then the manifest); the operator then finds the manifest and the pods restore from it.
if [[ -f operator/ember_operator/main.py ]]; then
  sleep 5
  DEMO_NAMESPACE="$DEMO_NAMESPACE" python - <<'PY' || log "stand-in SAVE failed (deployments keep serving natively)"
import json, os, subprocess
from ember.archive.bundle import write_archive
from ember_testing.synthetic import synthetic_graphset, synthetic_images
from ember.identity import CompatKey
from ember.store import open_store
from ember_operator.api import GraphArchiveSpec

# Only the demo's namespace: archives of test namespaces are the tests' own business.
out = subprocess.run([os.environ["EMBER_E2E_KUBECTL"], "get", "grapharchives", "-n", os.environ["DEMO_NAMESPACE"],
                      "-o", "json"],
                     capture_output=True, text=True, check=True).stdout
compat = CompatKey(gpu_name="kwok", compute_capability="9.0", driver="0", cuda="13.0")
for ga in json.loads(out)["items"]:
    if (ga.get("status") or {}).get("phase") == "Available":
        continue
    spec = GraphArchiveSpec.model_validate(ga["spec"])
    store = open_store(spec.store.uri(), **({"endpoint": spec.store.s3.endpoint} if spec.store.s3
                                              and spec.store.s3.endpoint else {}))
    result = write_archive(store, synthetic_graphset(graphs=4, nodes=30, groups=1),
                           spec.identity.to_identity(), compat, kernel_images=synthetic_images())
    print(f"stand-in SAVE: {ga['metadata']['name']} -> {result.manifest_uri}")
PY
  sleep 5
fi
# ---- end of operator section -------------------------------------------------------------------

log "cluster:"
kubectl get nodes -L nvidia.com/gpu.product
kubectl get modeldeployments,grapharchives -A 2>/dev/null || true
log "KUBECONFIG=$KUBECONFIG (source $WORK/env for kubectl, S3 endpoint and credentials)"

#!/usr/bin/env bash
# Local Kubernetes control plane + MinIO for ember's k8s/s3 test tiers, all on 127.0.0.1.
#
#   e2e/cluster.sh up       build what is missing, start what is not running (idempotent)
#   e2e/cluster.sh down     stop the processes `up` started (by pid) and drop their state
#   e2e/cluster.sh status   what runs, where
#   e2e/cluster.sh env      print the env file path (source it: KUBECONFIG, S3 endpoint, keys)
#   e2e/cluster.sh restart COMPONENT   stop and start one process (kube-apiserver, minio, ...)
#
# Start order: etcd -> kube-apiserver -> kube-controller-manager + kube-scheduler -> kwok ->
# fake GPU nodes (e2e/kwok/nodes.yaml) -> metrics-server -> MinIO (+ bucket). Binaries come from e2e/build.sh.
# Files: e2e/.work/kubeconfig (admin), e2e/.work/env, e2e/.work/run/{pki,logs,pids,...}.
set -euo pipefail

E2E="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${EMBER_E2E_WORK:-$E2E/.work}"
RUN="$WORK/run"
PKI="$RUN/pki"
LOGS="$RUN/logs"
PIDS="$RUN/pids"
KUBECONFIG_PATH="$WORK/kubeconfig"
ENV_FILE="$WORK/env"
# shellcheck source=versions.env
source "$E2E/versions.env"

HOST=127.0.0.1
ETCD_PORT="${EMBER_ETCD_PORT:-23790}"
ETCD_PEER_PORT="${EMBER_ETCD_PEER_PORT:-23800}"
APISERVER_PORT="${EMBER_APISERVER_PORT:-16443}"
KCM_PORT="${EMBER_KCM_PORT:-17257}"
SCHEDULER_PORT="${EMBER_SCHEDULER_PORT:-17259}"
KWOK_PORT="${EMBER_KWOK_PORT:-17247}"
METRICS_SERVER_PORT="${EMBER_METRICS_SERVER_PORT:-17443}"
MINIO_PORT="${EMBER_MINIO_PORT:-19000}"
MINIO_CONSOLE_PORT="${EMBER_MINIO_CONSOLE_PORT:-19001}"
S3_BUCKET="${EMBER_S3_BUCKET:-ember-test}"
S3_REGION=us-east-1
SERVICE_CIDR=10.96.0.0/16
POD_CIDR=10.244.0.0/16

K8S_BIN="$WORK/bin/kubernetes-$KUBERNETES_VERSION"
ETCD_BIN="$WORK/bin/etcd-$ETCD_VERSION/etcd"
KWOK_BIN="$WORK/bin/kwok-$KWOK_VERSION/kwok"
MINIO_BIN="$WORK/bin/minio-$MINIO_VERSION/minio"
METRICS_SERVER_BIN="$WORK/bin/metrics-server-$METRICS_SERVER_VERSION/metrics-server"
KUBECTL="$K8S_BIN/kubectl"

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- processes (by pid file)

pid_of() { [[ -f "$PIDS/$1.pid" ]] && cat "$PIDS/$1.pid" || true; }

# running NAME: the pid in NAME's pid file is alive and still runs what we started (a binary
# from e2e/.work/bin, or the operator that e2e/demo.sh starts), not a recycled pid.
running() {
  local pid pattern="^$WORK/bin/"
  [[ "$1" == operator ]] && pattern="ember[-_]operator"
  pid="$(pid_of "$1")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -Eq "$pattern"
}

START_MARK="--- e2e/cluster.sh started"  # spawn's first line in a component's log

# spawn NAME CMD...: start CMD detached (own session, survives the caller), log and pid files.
spawn() {
  local name="$1"; shift
  mkdir -p "$LOGS" "$PIDS"
  # The daemons outlive this script: they inherit none of its descriptors above 2 (fd 9, the
  # cluster lock; a caller's lock, as in `flock FILE e2e/test.sh`), or those locks would stay held
  # for as long as the cluster runs.
  (
    for fd in /proc/self/fd/*; do
      fd="${fd##*/}"
      if ((fd > 2)); then eval "exec ${fd}>&-"; fi
    done
    echo "$START_MARK $name at $(date -u +%FT%TZ)" >>"$LOGS/$name.log"
    exec setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null
  ) &
  local pid=$! i
  echo "$pid" >"$PIDS/$name.pid"
  # Until the subshell has closed its descriptors and exec'd CMD, its cmdline is bash's or
  # setsid's, and `running` would call it gone: wait (10 s at most) until CMD runs or the pid exits.
  for i in $(seq 1 200); do
    { running "$name" || ! kill -0 "$pid" 2>/dev/null; } && break
    sleep 0.05
  done
  log "started $name (pid $pid, log $LOGS/$name.log)"
}

stop() {
  local name="$1" pid i
  pid="$(pid_of "$name")"
  if running "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    log "stopped $name (pid $pid)"
  fi
  rm -f "$PIDS/$name.pid"
}

# The last 30 lines NAME logged since its latest start (logs are appended across restarts).
log_tail() {
  awk -v mark="$START_MARK" 'index($0, mark) == 1 { n = 0 } { line[n++] = $0 }
    END { for (i = (n > 30 ? n - 30 : 0); i < n; i++) print line[i] }' "$LOGS/$1.log" >&2 || true
}

# wait_for WHAT SECONDS NAME CMD...: poll CMD until it succeeds; fail with NAME's log tail.
wait_for() {
  local what="$1" secs="$2" name="$3"; shift 3
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if [[ -n "$name" ]] && ! running "$name"; then
      log_tail "$name"
      die "$name exited while waiting for $what (log: $LOGS/$name.log)"
    fi
    if ((SECONDS >= deadline)); then
      [[ -n "$name" ]] && log_tail "$name"
      die "timed out after ${secs}s waiting for $what"
    fi
    sleep 0.5
  done
}

port_free() { ! (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

require_port() {
  port_free "$1" || die "port $HOST:$1 for $2 is taken by another process (set EMBER_*_PORT to move it)"
}

# ---------------------------------------------------------------- certificates and kubeconfigs

gen_cert() { # NAME CN ORG [SANS]: a client/server certificate signed by the cluster CA.
  local name="$1" cn="$2" org="$3" sans="${4:-}" subj="/CN=$2"
  [[ -f "$PKI/$name.crt" ]] && return 0
  [[ -n "$org" ]] && subj="/O=$org/CN=$cn"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -subj "$subj" \
    -out "$PKI/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    if [[ -n "$sans" ]]; then echo "subjectAltName=$sans"; fi
  } >"$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/${5:-ca}.crt" -CAkey "$PKI/${5:-ca}.key" \
    -CAcreateserial -days 3650 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

gen_ca() { # NAME CN
  [[ -f "$PKI/$1.crt" ]] && return 0
  openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -subj "/CN=$2" -days 3650 \
    -sha256 -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" -out "$PKI/$1.crt" 2>/dev/null
}

write_kubeconfig() { # PATH CERT_NAME USER
  b64() { base64 -w0 <"$1"; }
  # Written to a temp file and renamed: other test sessions may be reading the kubeconfig.
  cat >"$1.tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ember-local
  cluster:
    server: https://$HOST:$APISERVER_PORT
    certificate-authority-data: $(b64 "$PKI/ca.crt")
users:
- name: $3
  user:
    client-certificate-data: $(b64 "$PKI/$2.crt")
    client-key-data: $(b64 "$PKI/$2.key")
contexts:
- name: ember-local
  context: {cluster: ember-local, user: $3, namespace: default}
current-context: ember-local
EOF
  chmod 600 "$1.tmp"
  mv -f "$1.tmp" "$1"
}

gen_pki() {
  mkdir -p "$PKI" && chmod 700 "$PKI"
  gen_ca ca ember-local-ca
  gen_ca front-proxy-ca ember-local-front-proxy-ca
  gen_cert apiserver kube-apiserver "" \
    "IP:$HOST,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  gen_cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  gen_cert admin ember-admin system:masters
  gen_cert controller-manager system:kube-controller-manager ""
  gen_cert scheduler system:kube-scheduler ""
  gen_cert kwok kwok-controller system:masters "IP:$HOST,DNS:localhost"
  # The aggregator checks the serving cert against <service>.<namespace>.svc.
  gen_cert metrics-server metrics-server system:masters \
    "IP:$HOST,DNS:localhost,DNS:metrics-server.kube-system.svc"
  gen_cert front-proxy-client front-proxy-client "" "" front-proxy-ca
  if [[ ! -f "$PKI/sa.key" ]]; then
    openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
    openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
  write_kubeconfig "$RUN/controller-manager.kubeconfig" controller-manager system:kube-controller-manager
  write_kubeconfig "$RUN/scheduler.kubeconfig" scheduler system:kube-scheduler
  write_kubeconfig "$RUN/kwok.kubeconfig" kwok kwok-controller
  write_kubeconfig "$RUN/metrics-server.kubeconfig" metrics-server metrics-server
  write_kubeconfig "$KUBECONFIG_PATH" admin ember-admin
}

# ---------------------------------------------------------------- components

curl_k8s() { curl -fsS --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$@"; }
kubectl() { "$KUBECTL" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

start_etcd() {
  running etcd && return 0
  require_port "$ETCD_PORT" etcd
  spawn etcd "$ETCD_BIN" --name ember-local --data-dir "$RUN/etcd-data" \
    --listen-client-urls "http://$HOST:$ETCD_PORT" --advertise-client-urls "http://$HOST:$ETCD_PORT" \
    --listen-peer-urls "http://$HOST:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://$HOST:$ETCD_PEER_PORT" \
    --initial-cluster "ember-local=http://$HOST:$ETCD_PEER_PORT" \
    --listen-metrics-urls "" --unsafe-no-fsync --quota-backend-bytes 4294967296 --log-level warn
  wait_for "etcd health" 60 etcd curl -fsS --max-time 2 "http://$HOST:$ETCD_PORT/health"
}

start_apiserver() {
  running kube-apiserver && return 0
  require_port "$APISERVER_PORT" kube-apiserver
  spawn kube-apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers "http://$HOST:$ETCD_PORT" \
    --bind-address "$HOST" --advertise-address "$HOST" --secure-port "$APISERVER_PORT" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --authorization-mode RBAC --allow-privileged=true \
    --endpoint-reconciler-type none \
    --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" \
    --requestheader-allowed-names front-proxy-client \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --requestheader-group-headers X-Remote-Group --requestheader-username-headers X-Remote-User \
    --proxy-client-cert-file "$PKI/front-proxy-client.crt" \
    --proxy-client-key-file "$PKI/front-proxy-client.key" \
    --profiling=false --v=1
  wait_for "kube-apiserver /readyz" 120 kube-apiserver curl_k8s "https://$HOST:$APISERVER_PORT/readyz"
}

start_controller_manager() {
  running kube-controller-manager && return 0
  require_port "$KCM_PORT" kube-controller-manager
  local kc="$RUN/controller-manager.kubeconfig"
  spawn kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address "$HOST" --secure-port "$KCM_PORT" --cert-dir "$RUN/controller-manager-certs" \
    --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --controllers '*,-node-ipam-controller,-service-lb-controller,-cloud-node-lifecycle-controller,-node-route-controller' \
    --horizontal-pod-autoscaler-sync-period 5s \
    --profiling=false --v=1
}

start_scheduler() {
  running kube-scheduler && return 0
  require_port "$SCHEDULER_PORT" kube-scheduler
  local kc="$RUN/scheduler.kubeconfig"
  spawn kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address "$HOST" --secure-port "$SCHEDULER_PORT" --cert-dir "$RUN/scheduler-certs" \
    --leader-elect=false --profiling=false --v=1
}

start_kwok() {
  running kwok && return 0
  require_port "$KWOK_PORT" kwok
  # kwok also plays every fake node's kubelet endpoint (TLS on $KWOK_PORT, the nodes' status
  # port) and serves fake resource metrics there for metrics-server (e2e/kwok/metrics.yaml).
  spawn kwok "$KWOK_BIN" --kubeconfig "$RUN/kwok.kubeconfig" \
    --config "$E2E/kwok/stages.yaml" --config "$E2E/kwok/metrics.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-ip "$HOST" --node-port "$KWOK_PORT" --cidr "$POD_CIDR" --node-lease-duration-seconds 40 \
    --server-address "$HOST:$KWOK_PORT" \
    --tls-cert-file "$PKI/kwok.crt" --tls-private-key-file "$PKI/kwok.key"
}

# metrics-server behind the aggregated API metrics.k8s.io (what the HPA controller reads). The
# APIService points at an ExternalName Service "localhost", so the apiserver dials
# https://localhost:$METRICS_SERVER_PORT without kube-proxy or pod networking.
start_metrics_server() {
  if ! running metrics-server; then
    require_port "$METRICS_SERVER_PORT" metrics-server
    local kc="$RUN/metrics-server.kubeconfig"
    spawn metrics-server "$METRICS_SERVER_BIN" \
      --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
      --bind-address "$HOST" --secure-port "$METRICS_SERVER_PORT" \
      --tls-cert-file "$PKI/metrics-server.crt" --tls-private-key-file "$PKI/metrics-server.key" \
      --kubelet-insecure-tls --kubelet-use-node-status-port \
      --kubelet-preferred-address-types InternalIP --metric-resolution 10s --kubelet-request-timeout 5s
  fi
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata: {name: metrics-server, namespace: kube-system}
spec:
  type: ExternalName
  externalName: localhost
  ports: [{name: https, port: $METRICS_SERVER_PORT, protocol: TCP}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta1.metrics.k8s.io}
spec:
  group: metrics.k8s.io
  version: v1beta1
  service: {name: metrics-server, namespace: kube-system, port: $METRICS_SERVER_PORT}
  caBundle: $(base64 -w0 <"$PKI/ca.crt")
  groupPriorityMinimum: 100
  versionPriority: 100
EOF
  wait_for "metrics.k8s.io APIService Available" 90 metrics-server \
    kubectl wait --for condition=Available --timeout=2s apiservice/v1beta1.metrics.k8s.io
}

# MinIO credentials are generated once per run folder and kept in run/minio.env.
minio_credentials() {
  if [[ ! -f "$RUN/minio.env" ]]; then
    umask 077
    printf 'MINIO_ROOT_USER=ember-%s\nMINIO_ROOT_PASSWORD=%s\n' \
      "$(openssl rand -hex 6)" "$(openssl rand -hex 24)" >"$RUN/minio.env"
  fi
  # shellcheck disable=SC1091
  source "$RUN/minio.env"
}

s3_curl() { # METHOD PATH: a SigV4-signed request to MinIO.
  curl -fsS --max-time 10 -X "$1" --aws-sigv4 "aws:amz:$S3_REGION:s3" \
    --user "$MINIO_ROOT_USER:$MINIO_ROOT_PASSWORD" "http://$HOST:$MINIO_PORT$2"
}

start_minio() {
  minio_credentials
  if ! running minio; then
    require_port "$MINIO_PORT" minio
    require_port "$MINIO_CONSOLE_PORT" "minio console"
    mkdir -p "$RUN/minio-data"
    MINIO_ROOT_USER="$MINIO_ROOT_USER" MINIO_ROOT_PASSWORD="$MINIO_ROOT_PASSWORD" \
      MINIO_BROWSER=off MINIO_UPDATE=off MINIO_REGION="$S3_REGION" \
      spawn minio "$MINIO_BIN" server --address "$HOST:$MINIO_PORT" \
      --console-address "$HOST:$MINIO_CONSOLE_PORT" --quiet "$RUN/minio-data"
  fi
  wait_for "MinIO /minio/health/ready" 60 minio \
    curl -fsS --max-time 2 "http://$HOST:$MINIO_PORT/minio/health/ready"
  if ! s3_curl HEAD "/$S3_BUCKET" >/dev/null 2>&1; then
    s3_curl PUT "/$S3_BUCKET" >/dev/null || die "could not create bucket $S3_BUCKET"
    log "created bucket $S3_BUCKET"
  fi
}

nodes_ready() {
  local want got
  want="$(grep -c '^kind: Node' "$E2E/kwok/nodes.yaml")"
  got="$(kubectl get nodes -l type=kwok \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    grep -c '^True$' || true)"
  [[ "$got" -ge "$want" ]]
}

start_nodes() {
  kubectl apply -f "$E2E/kwok/nodes.yaml" >/dev/null
  wait_for "fake nodes Ready" 120 kwok nodes_ready
}

write_env() {
  minio_credentials
  umask 077
  cat >"$ENV_FILE.tmp" <<EOF
# Written by e2e/cluster.sh up: source it to talk to the local cluster and MinIO.
export KUBECONFIG=$KUBECONFIG_PATH
export EMBER_E2E_KUBECTL=$KUBECTL
export EMBER_E2E_HELM=$WORK/bin/helm-$HELM_VERSION/helm
export EMBER_S3_ENDPOINT=http://$HOST:$MINIO_PORT
export EMBER_S3_BUCKET=$S3_BUCKET
export EMBER_S3_REGION=$S3_REGION
export AWS_ACCESS_KEY_ID=$MINIO_ROOT_USER
export AWS_SECRET_ACCESS_KEY=$MINIO_ROOT_PASSWORD
export AWS_DEFAULT_REGION=$S3_REGION
EOF
  mv "$ENV_FILE.tmp" "$ENV_FILE"
}

# ---------------------------------------------------------------- commands

cmd_up() {
  mkdir -p "$WORK"
  exec 9>"$WORK/cluster.lock"
  flock -w 900 9 || die "another e2e/cluster.sh holds $WORK/cluster.lock"
  local t0=$SECONDS
  command -v openssl >/dev/null || die "openssl is needed to generate the cluster certificates"
  "$E2E/build.sh"
  mkdir -p "$RUN" "$LOGS" "$PIDS"
  gen_pki
  start_etcd
  start_apiserver
  start_controller_manager
  start_scheduler
  start_kwok
  start_nodes
  wait_for "default service account" 60 kube-controller-manager \
    kubectl get serviceaccount default -n default
  start_metrics_server
  start_minio
  write_env
  log "up in $((SECONDS - t0))s: KUBECONFIG=$KUBECONFIG_PATH, env: $ENV_FILE"
}

cmd_down() {
  mkdir -p "$WORK"
  exec 9>"$WORK/cluster.lock"
  flock -w 300 9 || die "another e2e/cluster.sh holds $WORK/cluster.lock"
  local name
  # Clients first, etcd last; each gets up to 10 s after SIGTERM, then SIGKILL.
  for name in operator minio metrics-server kwok kube-scheduler kube-controller-manager; do
    stop "$name" &
  done
  wait
  stop kube-apiserver
  stop etcd
  # State is per run: the next `up` starts from an empty etcd and MinIO with fresh credentials.
  rm -rf "$RUN" "$ENV_FILE" "$KUBECONFIG_PATH"
  log "down"
}

# restart NAME: stop one component (SIGTERM, then SIGKILL after 10 s) and start it again with the
# same flags, state and certificates (the fault tests: tests/k8s/test_faults.py).
cmd_restart() {
  local name="${1:-}"
  mkdir -p "$WORK"
  exec 9>"$WORK/cluster.lock"
  flock -w 300 9 || die "another e2e/cluster.sh holds $WORK/cluster.lock"
  case "$name" in
    kube-apiserver) stop kube-apiserver; start_apiserver ;;
    kube-controller-manager) stop kube-controller-manager; start_controller_manager ;;
    kube-scheduler) stop kube-scheduler; start_scheduler ;;
    kwok) stop kwok; start_kwok ;;
    minio) stop minio; start_minio ;;
    *) die "restart: unknown component '$name' (kube-apiserver, kube-controller-manager, kube-scheduler, kwok, minio)" ;;
  esac
}

cmd_status() {
  local name rc=0
  for name in etcd kube-apiserver kube-controller-manager kube-scheduler kwok metrics-server minio; do
    if running "$name"; then
      printf '%-24s running  pid %s\n' "$name" "$(pid_of "$name")"
    else
      printf '%-24s stopped\n' "$name"; rc=1
    fi
  done
  if running kube-apiserver; then
    printf '%-24s %s\n' "apiserver /readyz" "$(curl_k8s "https://$HOST:$APISERVER_PORT/readyz" 2>&1 || true)"
    printf 'KUBECONFIG=%s\n' "$KUBECONFIG_PATH"
    kubectl get nodes -L nvidia.com/gpu.product,nvidia.com/gpu.count 2>&1 || true
  fi
  if running minio; then
    printf 'S3 endpoint http://%s:%s bucket %s (credentials in %s)\n' "$HOST" "$MINIO_PORT" "$S3_BUCKET" "$ENV_FILE"
  fi
  return $rc
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "$ENV_FILE" ;;
  restart) cmd_restart "${2:-}" ;;
  *) echo "usage: $0 up|down|status|env|restart COMPONENT" >&2; exit 2 ;;
esac

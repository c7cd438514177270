#!/usr/bin/env bash
# Build the local control plane and MinIO from Go module sources (idempotent).
#
#   e2e/build.sh [kubernetes|etcd|kwok|metrics-server|helm|minio|promtool ...]   (default: all)
#   e2e/build.sh --check      exit 1 (naming them) if pinned binaries are missing
#   e2e/build.sh --lean ...   the same builds, then the module cache is deleted too (CI)
#
# Versions come from e2e/versions.env. Binaries land in e2e/.work/bin/<component>-<version>/ and
# are reused when present; the module cache lives in e2e/.work/gomodcache. The build cache
# (e2e/.work/gocache) is emptied after each component is built, so the disk holds one
# component's compiled packages at a time (Kubernetes' ~2.5 GB, not all six's ~6 GB: more than a
# CI machine may have free); EMBER_KEEP_GOCACHE=1 keeps it.
# Each build's wall time is appended to e2e/.work/build-times.log.
set -euo pipefail

E2E="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${EMBER_E2E_WORK:-$E2E/.work}"
# shellcheck source=versions.env
source "$E2E/versions.env"

export GOMODCACHE="$WORK/gomodcache"
export GOCACHE="$WORK/gocache"
export GOPATH="$WORK/gopath"
export CGO_ENABLED=0
# no DWARF in the compiled packages either (-ldflags -s -w drops it from the binaries): the
# build cache is ~15 % smaller
export GOFLAGS="-trimpath -buildvcs=false -gcflags=all=-dwarf=false"
# The builds share 2 cores with everything else: stay polite unless told otherwise.
NICE="${EMBER_BUILD_NICE:-10}"

# ensure_sum DIR: a wrapper module without go.sum gets one (first build after a version bump).
ensure_sum() {
  [[ -s "$1/go.sum" ]] && return 0
  log "$(basename "$1"): go mod tidy (no go.sum yet)"
  (cd "$1" && nice -n "$NICE" go mod tidy)
}

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

bin_dir() { echo "$WORK/bin/$1-$2"; }

# timed NAME VERSION CMD...: runs CMD, records the wall time.
timed() {
  local name="$1" version="$2"; shift 2
  local t0 t1
  t0=$(date +%s)
  nice -n "$NICE" "$@"
  t1=$(date +%s)
  printf '%s %s %s %ss\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$name" "$version" "$((t1 - t0))" \
    >> "$WORK/build-times.log"
  log "$name $version built in $((t1 - t0))s"
  [[ "${EMBER_KEEP_GOCACHE:-0}" == 1 ]] || go clean -cache
}

build_kubernetes() {
  local v="$KUBERNETES_VERSION" out minor
  out="$(bin_dir kubernetes "$v")"
  if [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/kube-scheduler" \
        && -x "$out/kubectl" ]]; then
    return 0
  fi
  minor="${v#v1.}"; minor="${minor%%.*}"
  local pkg=k8s.io/component-base/version cpkg=k8s.io/client-go/pkg/version
  local stamp="-X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  stamp+=" -X $cpkg.gitVersion=$v -X $cpkg.gitMajor=1 -X $cpkg.gitMinor=$minor -X $cpkg.gitTreeState=clean"
  log "kubernetes $v: building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl"
  ensure_sum "$E2E/go/kubernetes"
  mkdir -p "$out.tmp"
  # One invocation so the four commands share compiled packages; -s -w drops debug info.
  (cd "$E2E/go/kubernetes" &&
    timed kubernetes "$v" go build -ldflags "-s -w $stamp" -o "$out.tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_etcd() {
  local v="$ETCD_VERSION" out
  out="$(bin_dir etcd "$v")"
  [[ -x "$out/etcd" ]] && return 0
  log "etcd $v: building"
  ensure_sum "$E2E/go/etcd"
  mkdir -p "$out.tmp"
  (cd "$E2E/go/etcd" &&
    timed etcd "$v" go build -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$out" && mv "$out.tmp" "$out"
}

# go_install NAME VERSION PACKAGE BINARY [LDFLAGS]: `go install pkg@version` into the versioned
# bin folder.
go_install() {
  local name="$1" v="$2" pkg="$3" binary="$4" ldflags="-s -w ${5:-}" out
  out="$(bin_dir "$name" "$v")"
  [[ -x "$out/$binary" ]] && return 0
  log "$name $v: building $pkg"
  mkdir -p "$out.tmp"
  (cd "$WORK" && GOBIN="$out.tmp" timed "$name" "$v" go install -ldflags "$ldflags" "$pkg@$v")
  rm -rf "$out" && mv "$out.tmp" "$out"
}

build_kwok() { go_install kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok kwok; }
build_helm() {
  go_install helm "$HELM_VERSION" helm.sh/helm/v4/cmd/helm helm "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
}
build_metrics_server() {
  go_install metrics-server "$METRICS_SERVER_VERSION" sigs.k8s.io/metrics-server/cmd/metrics-server metrics-server
}
build_minio() { go_install minio "$MINIO_VERSION" github.com/minio/minio minio; }
# promtool checks the chart's alert rules (tests/unit/test_monitoring.py). Prometheus 3.x is
# tagged v0.3xx.y as a Go module (3.16.0 is v0.316.0). remove_all_sd (Prometheus' own build tag)
# leaves out the service-discovery plugins (AWS, Azure, GCE, Kubernetes, ... SDKs): rule checks
# need none of them, and the build downloads and compiles a fraction of the code.
build_promtool() {
  local v="$PROMETHEUS_VERSION" minor
  minor="${v#v0.3}"; minor="${minor%%.*}"
  GOFLAGS="$GOFLAGS -tags=remove_all_sd" go_install promtool "$v" \
    github.com/prometheus/prometheus/cmd/promtool promtool \
    "-X github.com/prometheus/common/version.Version=3.$((10#$minor)).${v##*.}"
}

# check: exit 1 and name what is missing when a pinned binary is not built yet.
check() {
  local missing=() f
  for f in "$(bin_dir kubernetes "$KUBERNETES_VERSION")"/{kube-apiserver,kube-controller-manager,kube-scheduler,kubectl} \
           "$(bin_dir etcd "$ETCD_VERSION")/etcd" "$(bin_dir kwok "$KWOK_VERSION")/kwok" \
           "$(bin_dir minio "$MINIO_VERSION")/minio" \
           "$(bin_dir metrics-server "$METRICS_SERVER_VERSION")/metrics-server" "$(bin_dir helm "$HELM_VERSION")/helm" \
           "$(bin_dir promtool "$PROMETHEUS_VERSION")/promtool"; do
    [[ -x "$f" ]] || missing+=("${f#"$WORK"/}")
  done
  ((${#missing[@]} == 0)) && return 0
  echo "not built: ${missing[*]}" >&2
  return 1
}

main() {
  if [[ "${1:-}" == "--check" ]]; then check; return; fi
  local lean=0
  if [[ "${1:-}" == "--lean" ]]; then lean=1; shift; fi
  command -v go >/dev/null || { echo "go not found: install Go >= 1.25 (https://go.dev/dl)" >&2; exit 1; }
  mkdir -p "$WORK/bin"
  local components=("$@")
  ((${#components[@]})) || components=(etcd kwok kubernetes minio metrics-server helm promtool)
  local c
  for c in "${components[@]}"; do
    case "$c" in
      kubernetes|etcd|kwok|helm|minio|promtool) "build_$c" ;;
      metrics-server) build_metrics_server ;;
      *) echo "unknown component: $c" >&2; exit 2 ;;
    esac
  done
  if ((lean)) && [[ -d "$GOMODCACHE" ]]; then
    log "deleting the module cache ($(du -sh "$GOMODCACHE" | cut -f1))"
    go clean -modcache
  fi
}

main "$@"

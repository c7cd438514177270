#!/usr/bin/env bash
# Build the operator and sidecar images without a container engine and without pulling a base
# image: the Dockerfile's `operator` and `sidecar` targets, assembled from Debian's packages.
#
#   images/build.sh [operator|sidecar ...]     (default: both)
#
# Result: an OCI image layout, build/images/oci, one tag per target (push it with
# `skopeo copy oci:build/images/oci:operator docker://REGISTRY/ember-operator:0.1.0`).
#
#   base      Debian bookworm, essential variant + python3, python3-venv, libstdc++6 and
#             ca-certificates (mmdebstrap); the user ember (uid/gid 65532, home /home/ember);
#             a venv in /opt/venv, first on PATH. One layer, shared by both images.
#   operator  base + the ember wheel with its `operator` extra; CMD ember-operator.
#   sidecar   base + the wheel with its `sidecar` extra, libember*.so in /opt/ember/lib; CMD
#             ember-sidecar.
#
# Each image runs as 65532:65532 (USER in the image config). The wheel is built from this checkout
# (`pip wheel`); its dependencies come from PyPI. Needs root (chroot, mounts), mmdebstrap and
# umoci (Debian packages) and Python >= 3.11. images/smoke.sh runs them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${EMBER_IMAGES_OUT:-$ROOT/build/images}"
OCI="$OUT/oci"
SUITE=bookworm
MIRROR="${EMBER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PYTHON="${PYTHON:-python3}"
PATH_IN_IMAGE=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# in_chroot ROOTFS CMD...: CMD inside ROOTFS with /dev, /proc and the host's DNS, in a private mount
# namespace (nothing stays mounted). resolv.conf is removed again: the runtime provides it.
in_chroot() {
  local rootfs="$1"; shift
  cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
  unshare --mount --propagation private --fork -- sh -ec 'r="$1"; shift; mount --rbind /dev "$r/dev"
    mount -t proc proc "$r/proc"; exec chroot "$r" "$@"' sh "$rootfs" "$@"
  rm -f "$rootfs/etc/resolv.conf"
}

build_wheel() {
  log "building the ember wheel"
  rm -rf "$OUT/wheels"
  "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$OUT/wheels" "$ROOT"
}

build_base() {
  log "base: Debian $SUITE (mmdebstrap) + the ember user + /opt/venv"
  rm -rf "$OCI" "$OUT/bundle-base"
  umoci init --layout "$OCI"
  umoci new --image "$OCI:base"
  umoci unpack --image "$OCI:base" "$OUT/bundle-base"
  rm -rf "$OUT/bundle-base/rootfs"
  mmdebstrap --quiet --variant=essential \
    --include=python3,python3-venv,libstdc++6,ca-certificates \
    --customize-hook='echo "ember:x:65532:65532:ember:/home/ember:/usr/sbin/nologin" >> "$1/etc/passwd"' \
    --customize-hook='echo "ember:x:65532:" >> "$1/etc/group"' \
    --customize-hook='install -d -o 65532 -g 65532 "$1/home/ember"' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -f "$1/etc/resolv.conf"' \
    "$SUITE" "$OUT/bundle-base/rootfs" "$MIRROR"
  umoci repack --image "$OCI:base" "$OUT/bundle-base"
  rm -rf "$OUT/bundle-base"
}

# build_target NAME EXTRA CMD: the base, plus the wheel with EXTRA installed into /opt/venv.
build_target() {
  local name="$1" extra="$2" cmd="$3" bundle="$OUT/bundle-$1" wheel
  log "$name: base + ember[$extra]"
  wheel="$(basename "$(echo "$OUT"/wheels/ember-*.whl)")"
  rm -rf "$bundle"
  umoci unpack --image "$OCI:base" "$bundle"
  cp "$OUT/wheels/$wheel" "$bundle/rootfs/tmp/"
  # pip inside trusts this machine's CA bundle (a proxy's, maybe) and uses its index and proxies.
  cp -L "${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}" "$bundle/rootfs/tmp/ca.crt"
  local env=(PATH="$PATH_IN_IMAGE" HOME=/root PIP_CERT=/tmp/ca.crt) v
  for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_DEFAULT_TIMEOUT http_proxy https_proxy no_proxy; do
    [[ -n "${!v:-}" ]] && env+=("$v=${!v}")
  done
  in_chroot "$bundle/rootfs" /usr/bin/env -i "${env[@]}" pip install -q --no-cache-dir \
    --disable-pip-version-check "/tmp/$wheel[$extra]"
  rm -f "$bundle/rootfs/tmp/$wheel" "$bundle/rootfs/tmp/ca.crt"
  if [[ "$name" == sidecar ]]; then  # the init container copies libember from here (pods.py)
    install -d "$bundle/rootfs/opt/ember/lib"
    cp "$bundle"/rootfs/opt/venv/lib/python3*/site-packages/ember/lib/libember{,_nccl}.so \
      "$bundle/rootfs/opt/ember/lib/"
  fi
  umoci repack --image "$OCI:$name" "$bundle"
  umoci config --image "$OCI:$name" --config.user 65532:65532 --config.workingdir /home/ember \
    --config.env "PATH=$PATH_IN_IMAGE" --config.env PYTHONUNBUFFERED=1 --config.cmd "$cmd"
  rm -rf "$bundle"
}

main() {
  [[ $(id -u) -eq 0 ]] || { echo "images/build.sh needs root (chroot, mounts)" >&2; exit 1; }
  local targets=("$@") t
  ((${#targets[@]})) || targets=(operator sidecar)
  for t in "${targets[@]}"; do
    [[ "$t" == operator || "$t" == sidecar ]] || { echo "unknown target: $t" >&2; exit 2; }
  done
  mkdir -p "$OUT"
  build_wheel
  build_base
  for t in "${targets[@]}"; do build_target "$t" "$t" "ember-$t"; done
  umoci ls --layout "$OCI"
  du -sh "$OCI"
}

main "$@"

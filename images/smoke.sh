#!/usr/bin/env bash
# Smoke-run the images images/build.sh wrote (CI, .ci/run stage `images`): each image is unpacked
# from the OCI layout and its commands run chrooted into its root filesystem, as the image's user
# with the image's environment (its config), as a container runtime would start them:
#
#   both      its CMD with --help; `ember doctor --json` reports libember loadable; libember loads
#             through ember.native; getpass.getuser() names the passwd entry of uid 65532
#   sidecar   the init container's copy of /opt/ember/lib/libember.so, and that copy loads
#
#   images/smoke.sh [operator|sidecar ...]     (default: both)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${EMBER_IMAGES_OUT:-$ROOT/build/images}"
OCI="$OUT/oci"

BUNDLE=""
ENV=()
USERSPEC=""
CMD=()

# unpack NAME: the image into $BUNDLE; its environment, user and command from the runtime config.
unpack() {
  BUNDLE="$OUT/smoke-$1"
  rm -rf "$BUNDLE"
  umoci unpack --image "$OCI:$1" "$BUNDLE" >/dev/null
  local config="$BUNDLE/config.json"
  mapfile -t ENV < <(python3 -c 'import json, sys; print(*json.load(open(sys.argv[1]))["process"]["env"], sep="\n")' "$config")
  USERSPEC="$(python3 -c 'import json, sys; u = json.load(open(sys.argv[1]))["process"]["user"]; print(u["uid"], u["gid"], sep=":")' "$config")"
  mapfile -t CMD < <(python3 -c 'import json, sys; print(*json.load(open(sys.argv[1]))["process"]["args"], sep="\n")' "$config")
}

# run CMD...: CMD in the unpacked image, as its user, with its environment (and HOME=/tmp, as the
# pods set it), /dev and /proc mounted in a private mount namespace.
run() {
  echo "+ $*" >&2
  unshare --mount --propagation private --fork -- sh -ec 'r="$1"; shift; mount --rbind /dev "$r/dev"
    mount -t proc proc "$r/proc"; exec chroot --userspec="$0" "$r" "$@"' \
    "$USERSPEC" "$BUNDLE/rootfs" /usr/bin/env -i "${ENV[@]}" HOME=/tmp "$@"
}

LOADS='import ember.native as n; p = n.find_library(); n.load_library(p); print("libember loaded:", p)'

smoke() {
  local name="$1" doctor
  unpack "$name"
  [[ "$USERSPEC" == 65532:65532 ]] || { echo "$name: runs as $USERSPEC, not 65532:65532" >&2; return 1; }
  [[ "${CMD[*]}" == "ember-$name" ]] || { echo "$name: CMD is '${CMD[*]}'" >&2; return 1; }
  run "${CMD[@]}" --help >/dev/null
  doctor="$(run ember doctor --json)"
  python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["native_loadable"], r' "$doctor"
  run python -c "$LOADS"
  [[ "$(run python -c 'import getpass; print(getpass.getuser())')" == ember ]]
  if [[ "$name" == sidecar ]]; then  # the init container: cp /opt/ember/lib/libember.so <shared>
    run cp /opt/ember/lib/libember.so /tmp/libember.so
    run env EMBER_LIB=/tmp/libember.so python -c "$LOADS"
  fi
  rm -rf "$BUNDLE"
  echo "$name: smoke-run passed"
}

main() {
  local targets=("$@") t
  ((${#targets[@]})) || targets=(operator sidecar)
  for t in "${targets[@]}"; do smoke "$t"; done
}

main "$@"

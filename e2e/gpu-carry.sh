#!/usr/bin/env bash
# What a GPU session carries to the device beyond the tree: wheels the image lacks, and vLLM 0.26
# (the device kit, ../shared/tools/vllm-device-kit) in chunks that fit one call's 64 MiB with the
# tree. Run from the repository root.
#
#   here:    bash e2e/gpu-carry.sh prepare     # .whl/ .vk3/ (wheels), .vk0/ .vk1/ .vk2/ (kit chunks)
#   device, four calls back to back (the machine is given back after ~30 s with no call in
#   flight, and its /tmp with it):
#            bash e2e/gpu-carry.sh park .vk0   # carry [".vk0"]
#            bash e2e/gpu-carry.sh park .vk1   # carry [".vk1"]
#            bash e2e/gpu-carry.sh park .vk2   # carry [".vk2"]
#            bash e2e/gpu-carry.sh install     # carry [".whl", ".vk3"]
#   then `bash e2e/gpu-lanes.sh setup TAG` and the lanes, in the same call.
set -euo pipefail
KIT=${KIT:-../shared/tools/vllm-device-kit}
BUILD=${VKIT_BUILD:-/tmp/vkit-build}
CHUNK=44M  # + the tree (~8 MB) stays under a call's 64 MiB
PY=(--python-version 3.12 --only-binary=:all: --implementation cp --platform any
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
# ember's own dependencies the image lacks (pydantic as the kit pins it), the operator's (the warm
# benches import it) and pytest-timeout; .vk3: what `vllm serve` needs beyond the kit
WHEELS=(pydantic==2.14.3 pydantic_core==2.50.4 zstandard cryptography boto3 pytest_timeout pyyaml
        typing_extensions kubernetes kopf py-spy)
SERVE=(uvicorn watchfiles prometheus_fastapi_instrumentator model_hosting_container_standards)

prepare() {
  pip=${PIP:-python3 -m pip}
  rm -rf .whl .vk3 && mkdir -p .whl .vk3
  $pip download -q -d .whl "${PY[@]}" "${WHEELS[@]}"
  rm -f .whl/pytest-[0-9]*.whl .whl/pygments-*.whl  # the image has them
  $pip download -q -d .vk3 "${PY[@]}" "${SERVE[@]}"
  for f in .vk3/*.whl; do
    case ${f#.vk3/} in pydantic*|fastapi*|starlette*|typing_*|annotated_types*|setuptools*|prometheus_client*) rm -f "$f" ;; esac
  done
  if ! (cd "$BUILD" 2>/dev/null && cat part0? | sha256sum | cut -d' ' -f1 | grep -qf <(cut -d' ' -f1 SHA256)); then
    bash "$KIT/build.sh" "$BUILD"
  fi
  rm -rf .vk0 .vk1 .vk2 /tmp/ember-vk- && mkdir -p .vk0 .vk1 .vk2
  cat "$BUILD"/part0? | split -b "$CHUNK" -d -a 2 - /tmp/ember-vk-
  mv /tmp/ember-vk-00 .vk0/part00 && mv /tmp/ember-vk-01 .vk1/part01 && mv /tmp/ember-vk-02 .vk2/part02
  cp "$BUILD/SHA256" .vk2/
  du -sh .whl .vk0 .vk1 .vk2 .vk3
}

park() { mkdir -p /tmp/vkit && cp "$1"/* /tmp/vkit/ && ls -l /tmp/vkit; }

install() {  # the chunks parked (SHA256 with .vk2's), .whl and .vk3 carried in this call
  cat /tmp/vkit/part* > /tmp/vkit/v.tar.xz
  sha256sum -c /tmp/vkit/SHA256 || { echo "kit incomplete (machine recycled?): park every chunk again"; exit 3; }
  rm -rf /tmp/vsite && mkdir -p /tmp/vsite && tar -C /tmp/vsite -xJf /tmp/vkit/v.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite3 .vk3/*.whl
  echo "vLLM kit in /tmp/vsite, extras in /tmp/vsite3"
}

cmd=${1:-}; shift || true
case "$cmd" in
  prepare|park|install) "$cmd" "$@" ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac

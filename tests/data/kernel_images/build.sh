#!/usr/bin/env bash
# Builds the test fixtures from fixture.cu with the CUDA toolkit (run where nvcc is, e.g. the GPU
# machine): OUT/fixture.sm_90.cubin (one architecture), OUT/fixture.fatbin (sm_80 + sm_90 + PTX,
# every entry compressed) and OUT/fixture.fatbin.sm_90.cubin (cuobjdump's extraction of its sm_90
# entry, which kernel_images.fatbin_cubin must reproduce byte for byte).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); out=${1:-$here}; tmp=$(mktemp -d)
nvcc -cubin -arch=sm_90 -o "$out/fixture.sm_90.cubin" "$here/fixture.cu"
nvcc -fatbin -Xfatbin -compress-all -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
  -gencode arch=compute_90,code=compute_90 -o "$out/fixture.fatbin" "$here/fixture.cu"
(cd "$tmp" && cuobjdump -xelf all "$out/fixture.fatbin" > /dev/null && ls "$tmp")
cp "$(ls "$tmp"/*sm_90*.cubin | head -1)" "$out/fixture.fatbin.sm_90.cubin"
rm -rf "$tmp"

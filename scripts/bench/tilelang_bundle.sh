#!/usr/bin/env bash
# Pack TileLang for the GPU machines: bash scripts/bench/tilelang_bundle.sh  (dev machine, once)
#
# fla 0.6 refuses the backward of the gated delta-rule family (gated_deltanet, ...) on Hopper
# with Triton 3.4 to 3.7.0, which computes it wrong (fla issue #640), unless TileLang is
# installed: fla then runs that kernel through TileLang, compiled with nvcc. The GPU machines
# have Triton 3.6, nvcc and no network, and a device command carries at most 64 MiB. TileLang
# and what it needs are 83 MB as wheels, so this unpacks them for Python 3.12 on x86_64, drops
# what is never loaded (TVM's C++ sources, z3's second copy of its library) and writes
# .gpu-extra/tilelang.tar.xz (about 36 MB, gitignored). The ROCm and Ascend stub libraries stay:
# they are a few KB, and TVM's runtime opens them at import even on CUDA. On the device,
# carry .gpu-extra and unpack it next to the other wheels:
#   tar xJf .gpu-extra/tilelang.tar.xz -C /tmp/site
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheels" \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 cloudpickle==3.1.2 ml-dtypes==0.6.0 \
  z3-solver==4.15.4.0
for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
rm -rf "$work"/site/z3_solver-*.data "$work/site/tilelang/3rdparty/tvm/src"
chmod -R u+rwX,go+rX "$work/site"
chmod +x "$work"/site/tilelang/lib/*.so "$work"/site/z3/lib/*.so*
mkdir -p "$root/.gpu-extra"
tar cf - -C "$work/site" . | xz -9 -T0 > "$root/.gpu-extra/tilelang.tar.xz"
du -h "$root/.gpu-extra/tilelang.tar.xz"

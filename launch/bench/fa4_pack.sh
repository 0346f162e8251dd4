#!/usr/bin/env bash
# Packs FlashAttention-4 (the CuTe DSL kernels) for the GPU machine, whose image lacks it, in two
# git-ignored parts that each fit the device's 64 MiB carry beside the working tree:
#   .fa4one/a.tar.xz    (~50 MB) the CUTLASS DSL's IR library (_cutlass_ir.cu13...so, 193 MB unpacked)
#   .fa4extra/b.tar.xz  (~18 MB) everything else: flash_attn, quack, cutlass DSL, tvm_ffi (with
#                       tvm_ffi/lib/libtvm_ffi_testing.so, which FA4 imports), the cu13 runtime
# Run in the repository root after ../shared/bench/fa4_wheels.sh (it downloads .fa4/*.whl and
# .fa4big/libs_cu13.tar.xz). Shared objects are stripped, __pycache__ and the iket profiler (an
# injection library nothing imports) dropped. Takes ~3 minutes (xz -9e).
#
# On the device, two calls back to back (the machine stays warm ~30 s between them):
#   1. carry [".fa4one"]:   mkdir -p /tmp/site && tar xJf .fa4one/a.tar.xz -C /tmp/site
#   2. carry [".fa4extra"]: [ -d /tmp/site/nvidia_cutlass_dsl ] || exit 3   # went cold: repeat both
#                           [ -d /tmp/site/flash_attn ] || tar xJf .fa4extra/b.tar.xz -C /tmp/site
#                           ln -sfn ../kernels fm_parallel/kernels
#                           export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages FM_FA4_SITE=/tmp/site
# Checked 2026-12-06 on the H200: FA4 imported and ran (launch/bench/max_context.py, tests/gpu).
set -euo pipefail
[ -f .fa4big/libs_cu13.tar.xz ] && ls .fa4/*.whl >/dev/null 2>&1 || {
  echo "fa4_pack: run ../shared/bench/fa4_wheels.sh first (.fa4/*.whl, .fa4big/libs_cu13.tar.xz)" >&2; exit 1; }
for d in .fa4one .fa4extra; do
  git check-ignore -q "$d/x" || { echo "fa4_pack: $d/ must be git-ignored (.gitignore)" >&2; exit 1; }
done
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
tar xJf .fa4big/libs_cu13.tar.xz -C "$site"
for w in .fa4/*.whl; do python3 -m zipfile -e "$w" "$site"; done
rm -rf "$site"/*.dist-info "$site"/tvm_ffi/3rdparty "$site"/tvm_ffi/include "$site"/nvidia_cutlass_dsl/dsl_packages/iket/profiler
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$site" -name "*.so" -size +1M -exec strip --strip-unneeded {} \;
[ -f "$site/tvm_ffi/lib/libtvm_ffi_testing.so" ] || { echo "fa4_pack: tvm_ffi/lib/libtvm_ffi_testing.so missing" >&2; exit 1; }
ir=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
[ -f "$site/$ir" ] || { echo "fa4_pack: $ir missing from the wheels" >&2; exit 1; }
mkdir -p .fa4one .fa4extra
root=$PWD
(cd "$site" && tar cf - "$ir" | xz -T2 -9e > "$root/.fa4one/a.tar.xz") &
part_a=$!
(cd "$site" && tar cf - --exclude='_cutlass_ir.cu13*' . | xz -T2 -9e > "$root/.fa4extra/b.tar.xz")
wait "$part_a"
ls -l .fa4one/a.tar.xz .fa4extra/b.tar.xz

#!/usr/bin/env bash
# The GPU work still owed to issues 4 and 5, in stages that each fit one 10-minute device call.
# Run in the repository root on the H200, results under $OUT:
#
#   bash launch/bench/h200_session.sh unpack-libs   # call 1, carry [".fa4big"]: the FA4 CUDA 13 libraries
#   bash launch/bench/h200_session.sh verify        # call 2, carry [".fa4"]: cute + triton vs fp64, every family
#   bash launch/bench/h200_session.sh kernel causal docs dpo      # call 3, carry [".fa4"]: every peer + churn
#   bash launch/bench/h200_session.sh kernel sliding prefix multi # call 4, carry [".fa4"] (a call's 10 minutes
#                                                                 # do not hold all six families)
#   bash launch/bench/h200_session.sh tune          # call 5: Triton block shapes for D 64 / 128 / 256
#   bash launch/bench/h200_session.sh ab            # carry [".fa4one"]: cute with / without each FA4 change
#                                                   # (cute_fa4_patches) on every family at 16k, FA4 beside,
#                                                   # new-mask churn, after verifying the changed kernels
#   CHURN=16384 NS="16384 65536" bash launch/bench/h200_session.sh final   # carry [".fa4one"]: verify cute
#                                                   # (FA4 causal / varlen paths included), then cute, its
#                                                   # block-sparse path, FA4, Flex-FLASH at NS (+ churn)
#   bash launch/bench/h200_session.sh hf       # carry [".fa4one"]: the Hugging Face / trainer edges through
#                                              # the CUDA kernels, auto (CuTe) then Triton (verify_hf_gpu.py)
#   IMPLS="cute" NS="32768 131072" bash launch/bench/h200_session.sh cp   # carry [".fa4one"]: ring / Ulysses /
#                                              # hybrid on 4 ranks SHARING the one H200 (gloo, host-staged
#                                              # transfers), every family x balance vs one GPU (verify_multi_gpu.py --shared-gpu)
#   bash launch/bench/h200_session.sh cpcost   # carry [".fa4one"]: per-layer CP kernel / host time per rank and
#                                              # step on one GPU, and the P = 2, 4, 8 model (cp_layer_cost.py)
#   bash launch/bench/h200_session.sh cpall    # carry [".fa4one"]: both in one short call (one unpack): cute at
#                                              # 32k + 128k from host masks (the trainer's path), cute at 32k
#                                              # from device masks, Triton at 32k, then the cost model
#   bash launch/bench/h200_session.sh dpo      # carry [".fa4one"]: the trainer's shared-prompt DPO against TRL's
#                                              # layout, prompt : response 1024 : 1024 (DPO_SAMPLE), 16k and 64k
#   bash launch/bench/h200_session.sh next     # carry [".fa4one", ".fa4extra"]: what the 2026-12-03 sessions left:
#                                              # windows compile once (window_compiles.py), and issue 21's two masks
#                                              # (window_sinks, global_window: cute / Flex-FLASH / triton / Flex at
#                                              # 16k, 64k, cover slot included); CP with row windows at 128k is its
#                                              # own call each: IMPLS=cute NS=131072 CP_TIMEOUT=540 ... cp (then triton)
#   NS="16384" MASKS="global_window" bash launch/bench/h200_session.sh issue21  # carry [".fa4one", ".fa4extra"]:
#                                              # cute vs Flex-FLASH only (kernel.py with FA4 on the path; a bare
#                                              # kernel.py call lacks it and skips both), one (mask, N) costs minutes
#                                              # of compiles: one or two per call
#   bash launch/bench/h200_session.sh sched    # carry [".fa4one", ".fa4extra"]: the launch order (both backends):
#                                              # verify_gpu (VERIFY_IMPLS: cute triton), then IMPLS (cute / cute_lpt /
#                                              # Flex-FLASH) at NS (16k) on MASKS (global_window window_sinks sliding
#                                              # dpo prefix); IMPLS="triton flex" for Triton against Flex
#   AB_IMPL=triton NS=16384 MASKS="sliding window_sinks global_window dpo docs" bash launch/bench/h200_session.sh schedab
#                                              # carry [".fa4one", ".fa4extra"]: Triton's order before the launch
#                                              # order vs the shipped one (schedule_ab.py; AB_IMPL=cute: the CuTe A/B)
#   NS="16384 65536" bash launch/bench/h200_session.sh tbwd  # carry nothing: verify_gpu --impls triton, then the
#                                              # Triton backward piece by piece (block-shape variants) against Flex
#                                              # at NS on MASKS (docs dpo sliding prefix; triton_bwd.py). The first
#                                              # Flex compile on a fresh machine takes 220-260 s.
#   NS="32768 65536" bash launch/bench/h200_session.sh trainer  # carry [".fa4one", ".fa4extra"]: the trainer by
#                                              # attention (flashmask / Flex / SDPA dense), 8 timed steps on the same
#                                              # rows each, total tokens over total time (trainer_attention.py; a
#                                              # 128k row alone takes ~4 minutes of steps: its own call)
#   bash launch/bench/h200_session.sh hostprof # carry [".fa4one", ".fa4extra"]: where a CP layer's host time goes at
#                                              # P = 8 (cProfile of rank 0, docs and sliding + sinks, 128k, zigzag)
#   bash launch/bench/h200_session.sh graphs   # carry [".fa4one", ".fa4extra"]: the ring's layers captured as CUDA
#                                              # graphs: tests/distributed/test_ring_graphs.py on the GPU, then
#                                              # cp_layer_cost.py --graphs (128k, P 4 8, docs, sliding + sinks)
#   bash launch/bench/h200_session.sh launches # carry [".fa4one", ".fa4extra"]: FA4's compiled launches replayed without
#                                              # its Python (fa4_launch): the GPU tests, then cp_layer_cost with / without
#   NS="16384 65536" bash launch/bench/h200_session.sh costs   # carry [".fa4one"]: partial vs full tile cost
#                                                   # (cute_tile_costs.py), then cute / FA4 / Flex-FLASH at NS
#
# .fa4big and .fa4 come from ../shared/bench/fa4_wheels.sh run here (git-ignored). Stages 2 and 3
# need stage 1's /tmp/site on the same warm machine: if the machine went cold, stage 1 again.
#
# One call instead of two (a cold machine between the calls costs a new start, and starts fail often):
#   bash launch/bench/h200_session.sh pack     # here, once (~4 min on 2 cores): .fa4one/site.tar.xz,
#                                              # everything in one xz with the x86 filter, 55 MiB
# then carry [".fa4one"] in any stage and skip unpack-libs.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
stage=${1:-}
shift || true
case "$stage" in pack|unpack-libs|verify|kernel|tune|ab|costs|final|hf|cp|cpcost|cpall|dpo|next|issue21|sched|schedab|tbwd|trainer|hostprof|graphs|launches) ;; *)
  echo "usage: bash launch/bench/h200_session.sh pack|unpack-libs|verify|kernel [MASK ...]|tune|ab|costs [MASK ...]|final [MASK ...]|hf|cp|cpcost|cpall|dpo|next|issue21|sched|schedab|tbwd|trainer|hostprof|graphs|launches" >&2; exit 2 ;; esac
if [ "$stage" = pack ]; then  # on this machine, not the GPU one
  tmp=$(mktemp -d); tar xJf .fa4big/libs_cu13.tar.xz -C "$tmp"
  for w in .fa4/*.whl; do python3 -m zipfile -e "$w" "$tmp"; done
  # tvm_ffi/lib/libtvm_ffi_testing.so stays: FA4 imports it (an archive without it made impl="auto"
  # fall back to Triton silently on the H200, 2026-12-03).
  mkdir -p .fa4one && (cd "$tmp" && tar cf - . | xz -T0 --x86 --lzma2=preset=9e,dict=256MiB) > .fa4one/site.tar.xz
  rm -rf "$tmp"; grep -qx '/.fa4one/' .git/info/exclude || echo '/.fa4one/' >> .git/info/exclude
  du -sh .fa4one; exit 0
fi
mkdir -p "$OUT"
ln -sfn ../kernels fm_parallel/kernels  # the package mapping of pyproject, without installing (git-ignored)
export PYTHONPATH="$PWD"

fa4() {  # FlashAttention-4 + CuTe DSL on the path (from .fa4one, or stage 1's /tmp/site + .fa4)
  if [ -f .fa4one/site.tar.xz ] && [ ! -d /tmp/site/flash_attn ]; then  # once per machine
    mkdir -p /tmp/site && tar xJf .fa4one/site.tar.xz -C /tmp/site
  elif [ ! -f .fa4one/site.tar.xz ]; then
    [ -d /tmp/site/nvidia_cutlass_dsl ] || { echo "no /tmp/site: run the unpack-libs stage first (machine went cold?)"; exit 3; }
    for w in .fa4/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  fi
  # An archive packed without tvm_ffi's testing library (older pack stage): carry [".fa4extra"] holding it.
  if [ -f .fa4extra/libtvm_ffi_testing.so ] && [ ! -f /tmp/site/tvm_ffi/lib/libtvm_ffi_testing.so ]; then
    cp .fa4extra/libtvm_ffi_testing.so /tmp/site/tvm_ffi/lib/
  fi
  export PYTHONPATH="$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
  python3 -c "import fm_parallel.kernels.cute_flashmask" || echo "warning: the CuTe backend does not import; auto will pick Triton"
}

case "$stage" in
  unpack-libs)
    mkdir -p /tmp/site && tar xJf .fa4big/libs_cu13.tar.xz -C /tmp/site && ls /tmp/site | head ;;
  verify)
    fa4
    python3 launch/bench/verify_gpu.py --impls cute triton --json "$OUT/verify_gpu_h200.json" 2>&1 | tee "$OUT/verify.log" ;;
  kernel)
    fa4
    masks=("${@:-causal docs dpo}")
    tag="kernel_h200_cute_$(IFS=_; echo "${masks[*]}" | tr ' ' _)"
    churn=(); [[ " ${masks[*]} " == *" docs "* ]] && churn=(--churn 16384)  # once, with the docs family
    long=(--long); [[ " ${masks[*]} " == *" docs "* ]] && long=(--long 524288)  # bare --long: none
    python3 launch/bench/kernel.py --ns 16384 65536 --masks ${masks[*]} \
      --impls cute triton flex flex_flash fa4 sdpa --quick --extra-dims-at 0 "${long[@]}" \
      ${churn[@]+"${churn[@]}"} --out "$OUT" --tag "$tag" 2>&1 | tee "$OUT/$tag.log" ;;
  ab)
    fa4
    timeout 240 python3 launch/bench/verify_gpu.py --impls cute --json "$OUT/verify_gpu_h200_cute_patched.json" 2>&1 | tee "$OUT/verify_patched.log"
    python3 launch/bench/kernel.py --ns 16384 --masks causal docs sliding dpo prefix \
      --impls cute cute_sparse cute_col cute_plain fa4 --quick --extra-dims-at 0 --long --churn 16384 \
      --out "$OUT" --tag kernel_h200_cute_ab 2>&1 | tee "$OUT/kernel_h200_cute_ab.log" ;;
  costs)
    fa4
    python3 launch/bench/cute_tile_costs.py --n 16384 --masks docs sliding causal --out "$OUT" 2>&1 | tee "$OUT/costs.log"
    masks=("${@:-causal docs dpo sliding prefix}"); ns=(${NS:-16384 65536})
    python3 launch/bench/kernel.py --ns ${ns[*]} --masks ${masks[*]} --impls cute fa4 flex_flash --quick \
      --extra-dims-at 0 --long --out "$OUT" --tag "kernel_h200_cute_${NS_TAG:-16k_64k}" 2>&1 | tee "$OUT/kernel.log" ;;
  final)
    fa4
    timeout 170 python3 launch/bench/verify_gpu.py --impls cute --json "$OUT/verify_gpu_h200_cute_final.json" 2>&1 \
      | grep -v "UserWarning\|exe_args" | tee "$OUT/verify_final.log"
    masks=("${@:-causal docs dpo sliding prefix}"); ns=(${NS:-16384 65536})
    timeout ${KERNEL_TIMEOUT:-380} python3 launch/bench/kernel.py --ns ${ns[*]} --masks ${masks[*]} \
      --impls cute cute_sparse fa4 flex_flash --quick --extra-dims-at 0 --long ${CHURN:+--churn $CHURN} \
      --out "$OUT" --tag "kernel_h200_cute_final_${NS_TAG:-16k_64k}" 2>&1 | grep -v "UserWarning\|exe_args" \
      | tee "$OUT/kernel_final.log" ;;
  hf)
    fa4
    for impl in auto triton; do  # a failing case must not stop the next run (set -e, pipefail)
      { timeout 280 python3 launch/bench/verify_hf_gpu.py --impl $impl --out "$OUT/verify_hf_gpu_h200_$impl.json" 2>&1 || true; } \
        | grep -E "^(PASS|FAIL|[0-9]+/)" | tee -a "$OUT/verify_hf.log" || true
    done
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py -k top_left 2>&1 | tail -3 | tee -a "$OUT/verify_hf.log" ;;
  cp)
    fa4
    timeout ${CP_TIMEOUT:-540} python3 -m torch.distributed.run --nproc_per_node ${RANKS:-4} launch/bench/verify_multi_gpu.py \
      --shared-gpu --ns ${NS:-32768 131072} --heads 8 --kv-heads 2 --impls ${IMPLS:-cute triton} ${MASKS:+--masks $MASKS} \
      --out "$OUT" 2>&1 | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/verify_cp_virtual_${IMPLS// /_}.log" || true ;;
  cpcost)
    fa4
    timeout ${COST_TIMEOUT:-540} python3 launch/bench/cp_layer_cost.py --out "$OUT" ${COST_ARGS:-} 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/cp_layer_cost.log" || true ;;
  cpall)
    fa4
    run_cp() {  # IMPLS NS TIMEOUT MASK_ON (host: the trainer's path; device: a bare mask's)
      timeout $3 python3 -m torch.distributed.run --nproc_per_node 4 launch/bench/verify_multi_gpu.py --shared-gpu \
        --ns $2 --heads 8 --kv-heads 2 --impls $1 --mask-on $4 --out "$OUT/$1_$4" 2>&1 \
        | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/verify_cp_shared_$1_$4.log" | grep -v "^PASS" | tail -12 || true
    }
    run_cp cute "32768 131072" ${CUTE_TIMEOUT:-175} host
    [ "${CUTE_DEVICE_TIMEOUT:-60}" = 0 ] || run_cp cute "32768" ${CUTE_DEVICE_TIMEOUT:-60} device
    run_cp triton "32768" ${TRITON_TIMEOUT:-90} host
    timeout ${COST_TIMEOUT:-110} python3 launch/bench/cp_layer_cost.py --out "$OUT" \
      ${COST_ARGS:---ns 131072 --ps 2 4 8 --masks docs sliding_sinks --balances zigzag mask --layers 2 --max-seconds 80} 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/cp_layer_cost.log" | grep -v "^ " || true ;;
  dpo)
    fa4
    timeout ${DPO_TIMEOUT:-200} python3 launch/bench/trainer_attention.py --objective dpo --attention flashmask \
      --dpo-sample ${DPO_SAMPLE:-1024 1024} --lengths ${NS:-16384 65536} --out "$OUT" --name trainer_dpo_h200_1to1 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/trainer_dpo.log" | grep -v "^step\|^ " || true ;;
  next)
    fa4
    timeout ${WIN_TIMEOUT:-90} python3 launch/bench/window_compiles.py --n 32768 --windows 16 --out "$OUT" 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/window_compiles.log" | tail -3 || true
    timeout ${KERNEL_TIMEOUT:-240} python3 launch/bench/kernel.py --ns 16384 65536 --masks window_sinks global_window \
      --impls cute flex_flash triton flex --quick --extra-dims-at 0 --out "$OUT" --tag kernel_h200_issue21 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/kernel_issue21.log" | tail -14 || true
    ;;
  issue21)
    fa4
    timeout ${KERNEL_TIMEOUT:-500} python3 launch/bench/kernel.py --ns ${NS:-16384} --masks ${MASKS:-global_window} \
      --impls cute flex_flash --quick --extra-dims-at 0 --out "$OUT" --tag kernel_h200_issue21_cute 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/kernel_issue21_cute.log" | tail -8 || true
    ;;
  sched)  # the cost-ordered schedule: correctness, then cute (cost order) / cute_lpt (before) / Flex-FLASH
    fa4
    [ "${VERIFY_TIMEOUT:-300}" = 0 ] || { timeout ${VERIFY_TIMEOUT:-300} python3 launch/bench/verify_gpu.py --impls ${VERIFY_IMPLS:-cute triton} \
      --json "$OUT/verify_gpu_h200_cute_cost_order.json" 2>&1 | grep -v "UserWarning\|exe_args\|warnings.warn" \
      | tee "$OUT/verify_cost_order.log" | tail -30 || true; }
    timeout ${KERNEL_TIMEOUT:-360} python3 launch/bench/kernel.py --ns ${NS:-16384} \
      --masks ${MASKS:-global_window window_sinks sliding dpo prefix} --impls ${IMPLS:-cute cute_lpt flex_flash} --quick \
      --extra-dims-at 0 --long --out "$OUT" --tag kernel_h200_cost_order${TAG:-} 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/kernel_cost_order.log" | grep "impl=" || true ;;
  schedab)  # the CuTe schedules against each other (decoding cost, order direction, cost order)
    fa4
    timeout ${AB_TIMEOUT:-300} python3 launch/bench/schedule_ab.py --impl ${AB_IMPL:-cute} --n ${NS:-65536} \
      --masks ${MASKS:-window_sinks} --out "$OUT" 2>&1 | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/schedule_ab.log" | tail -20 || true ;;
  tbwd)  # no FA4 needed: Triton and Flex only
    [ "${VERIFY_TIMEOUT:-100}" = 0 ] || { timeout ${VERIFY_TIMEOUT:-100} python3 launch/bench/verify_gpu.py --impls triton \
      --json "$OUT/verify_gpu_h200_triton_bwd.json" 2>&1 | tee "$OUT/verify_triton_bwd.log" | tail -3 || true; }
    timeout ${TBWD_TIMEOUT:-420} python3 launch/bench/triton_bwd.py --ns ${NS:-16384} --masks ${MASKS:-docs dpo sliding prefix} \
      --out "$OUT" --tag triton_bwd_h200${TAG:-} 2>&1 | grep -v "UserWarning\|warnings.warn" | tee "$OUT/triton_bwd.log" || true ;;
  trainer)
    fa4
    timeout ${TRAINER_TIMEOUT:-540} python3 launch/bench/trainer_attention.py --lengths ${NS:-32768 65536} \
      --attention ${ATTENTIONS:-flashmask flex sdpa} ${WARM:+--warm-pass} --out "$OUT" --name trainer_h200${TAG:-_steady} 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/trainer.log" | grep -v "^step\|^ " || true ;;
  graphs)  # the ring's layers as CUDA graphs: the GPU tests (graphed vs eager vs one GPU), then their cost
    fa4
    if python3 -c "import pytest" 2>/dev/null; then
      { timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rA -p no:cacheprovider tests/distributed/test_ring_graphs.py 2>&1 || true; } \
        | grep -v "UserWarning\|exe_args\|warnings.warn" | tail -40 | tee "$OUT/graphs_tests.log" || true
    else
      echo "no pytest on this machine" | tee "$OUT/graphs_tests.log"
    fi
    timeout ${COST_TIMEOUT:-330} python3 launch/bench/cp_layer_cost.py --out "$OUT" --graphs \
      ${COST_ARGS:---ns 131072 --ps 4 8 --masks docs sliding_sinks --balances zigzag --layers 3 --max-seconds 200} 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/cp_layer_cost_graphs.log" || true ;;
  launches)  # FA4 launches recorded once and replayed (kernels/fa4_launch.py): the GPU tests (replays equal FA4's own
    # path; the ring layer after layer, graphed and eager), then the CP layer cost with and without them
    fa4
    { timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/test_fa4_launch.py \
        tests/distributed/test_ring_graphs.py 2>&1 || true; } | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" \
      | tee "$OUT/launch_tests.log" || true
    for mode in on off; do
      flag=""; [ $mode = off ] && flag="--fa4-python"
      timeout ${COST_TIMEOUT:-150} python3 launch/bench/cp_layer_cost.py --out "$OUT/$mode" $flag \
        ${COST_ARGS:---ns 131072 --ps 4 8 --masks docs sliding_sinks --balances zigzag --layers 2 --decoder-rest --max-seconds 110} \
        2>&1 | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/cp_layer_cost_launches_$mode.log" || true
    done ;;
  hostprof)
    fa4
    timeout ${COST_TIMEOUT:-300} python3 launch/bench/cp_layer_cost.py --out "$OUT/hostprof" --ns 131072 --ps 8 \
      --masks docs sliding_sinks --balances zigzag --layers 3 --host-ranks 1 --cprofile 2>&1 \
      | grep -v "UserWarning\|exe_args\|warnings.warn" | tee "$OUT/hostprof.log" | tail -60 || true ;;
  tune)
    python3 launch/bench/tune_triton.py --d 64 128 256 --n 16384 --out "$OUT" --tag tune_triton_all 2>&1 | tee "$OUT/tune.log" ;;
esac

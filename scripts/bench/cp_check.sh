#!/usr/bin/env bash
# Context parallelism on 2 GPUs against 1 GPU, at long context (one packed row of SEQ tokens):
#   bash scripts/bench/cp_check.sh [config ...]    default: configs/tiny/{llama,transformer,kda}.json
# First tests/gpu/test_context_parallel_kernels.py (the varlen and flex paths of the local-query
# attention against the whole batch's; KERNEL_TESTS=0 skips them). Then each config trains STEPS
# (default 10) steps of SEQ (default 32768) tokens with `bash train.sh` on 1 GPU and with NGPU=2
# --parallelism.context_parallel_degree 2, head-tail balanced and contiguous, in fp32 (so the
# curves agree to rounding; fp32 attention runs FlexAttention); llama also in bf16 (the varlen
# kernel), kda (fla's CP kernels) also with compiled blocks. Logs and metrics under $CP_OUT;
# last, one line per run: its losses and the largest relative difference from 1 GPU in the
# same precision. About 50 s per run on 2 H200s (35-45 s of it process start), more while fla's
# kernels autotune on a fresh machine: pass fewer configs to stay within one device command, or
# run two at once with their own CP_OUT (default /tmp/flame-gpu/cp).
# Every run of a config starts from one seed checkpoint (train_run.sh: seed_flags).
set -uo pipefail
out=${CP_OUT:-/tmp/flame-gpu/cp}  # packed into $OUT/<its name>.tgz after every run (train_run.sh)
mkdir -p "$out"
steps=${STEPS:-10}
seq=${SEQ:-32768}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/{llama,transformer,kda}.json)
export FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error

if [ "${KERNEL_TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_context_parallel_kernels.py > "$out/kernels.log" 2>&1
  echo "tests/gpu/test_context_parallel_kernels.py: exit $? ($(tail -1 "$out/kernels.log"))"
fi

common=(--job.config_file configs/debug.toml --training.steps "$steps" --metrics.log_freq 1 --checkpoint.no-enable
  --lr_scheduler.warmup_steps 2 --training.varlen --training.batch_size 1 --training.seq_len "$seq")
fp32=(--training.mixed_precision_param float32)
cp2=(--parallelism.context_parallel_degree 2)

source scripts/bench/train_run.sh

for config in "${configs[@]}"; do
  name=$(basename "$config" .json)
  flags=$(seed_flags "$config") || continue
  read -ra seed <<< "$flags"  # every run starts from the same weights
  train_run "$name-1gpu" 1 "$config" "${seed[@]}" "${fp32[@]}"
  train_run "$name-cp2" 2 "$config" "${seed[@]}" "${fp32[@]}" "${cp2[@]}"
  train_run "$name-cp2contiguous" 2 "$config" "${seed[@]}" "${fp32[@]}" "${cp2[@]}" \
    --parallelism.context_parallel_load_balancer None
  case $name in
    llama)
      train_run "$name-1gpu_bf16" 1 "$config" "${seed[@]}"
      train_run "$name-cp2_bf16" 2 "$config" "${seed[@]}" "${cp2[@]}" ;;
    kda) train_run "$name-cp2compiled" 2 "$config" "${seed[@]}" "${fp32[@]}" "${cp2[@]}" --training.compile ;;
  esac
done

python3 scripts/bench/compare_runs.py "$out" "context parallel vs 1 GPU"

#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs against 1 GPU, in fp32 so that the loss curves agree to rounding:
#   bash scripts/bench/tp_check.sh [config ...]    default: configs/tiny/{transformer,gla,gsa,delta_net,mamba2,llama}.json
# Each config trains STEPS (default 10) steps with `bash train.sh` on 1 GPU and with NGPU=2
# --parallelism.tensor_parallel_degree 2 (logits + CE under loss_parallel); llama and gla also
# with the fused loss; llama also with async TP (compiled blocks). Logs and metrics under
# /tmp/flame-gpu/tp; last, one line per run: its losses and the largest relative difference from 1 GPU.
# About 30-60 s per run: pass fewer configs to stay within one device command.
set -uo pipefail
out=/tmp/flame-gpu/tp  # packed into $OUT/tp.tgz after every run (train_run.sh)
mkdir -p "$out"
steps=${STEPS:-10}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/{transformer,gla,gsa,delta_net,mamba2,llama}.json)
export FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
# fp32 on both sides: without FSDP, torchtitan runs TP without mixed precision
common=(--job.config_file configs/debug.toml --training.steps "$steps" --metrics.log_freq 1 --checkpoint.no-enable
  --lr_scheduler.warmup_steps 2 --training.mixed_precision_param float32)
tp2=(--parallelism.tensor_parallel_degree 2)

source scripts/bench/train_run.sh

for config in "${configs[@]}"; do
  name=$(basename "$config" .json)
  train_run "$name-1gpu" 1 "$config"
  train_run "$name-tp2" 2 "$config" "${tp2[@]}"
  case $name in
    llama | gla) train_run "$name-tp2-fused" 2 "$config" "${tp2[@]}" --training.fused_cross_entropy on ;;
  esac
  [ "$name" = llama ] && train_run llama-tp2-async 2 "$config" "${tp2[@]}" --training.compile \
    --parallelism.enable_async_tensor_parallel
done

python3 scripts/bench/compare_runs.py "$out" "tensor parallel vs 1 GPU (fp32)"

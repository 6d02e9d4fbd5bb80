#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs against 1 GPU, in fp32 so that the loss curves agree to rounding:
#   bash scripts/bench/tp_check.sh [config ...]    default: configs/tiny/{transformer,gla,gsa,mamba2,llama}.json
# Each config trains STEPS (default 10) steps with `bash train.sh` on 1 GPU and with NGPU=2
# --parallelism.tensor_parallel_degree 2 (logits + CE under loss_parallel); llama and gla also
# with the fused loss; llama also with async TP (compiled blocks). Logs and metrics under
# /tmp/flame-gpu/tp; last, one line per run: its losses and the largest relative difference from 1 GPU.
# About 30-60 s per run: pass fewer configs to stay within one device command. Every run of a config
# starts from one seed checkpoint (train_run.sh: seed_flags). Not delta_net or gated_deltaproduct:
# their fla kernel refuses fp32 (preflight says so); their TP plans run in bf16 under TP x FSDP.
set -uo pipefail
out=/tmp/flame-gpu/tp  # packed into $OUT/tp.tgz after every run (train_run.sh)
mkdir -p "$out"
steps=${STEPS:-10}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/{transformer,gla,gsa,mamba2,llama}.json)
export FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
# fp32 on both sides: without FSDP, torchtitan runs TP without mixed precision
common=(--job.config_file configs/debug.toml --training.steps "$steps" --metrics.log_freq 1 --checkpoint.no-enable
  --lr_scheduler.warmup_steps 2 --training.mixed_precision_param float32)
tp2=(--parallelism.tensor_parallel_degree 2)

source scripts/bench/train_run.sh

for config in "${configs[@]}"; do
  name=$(basename "$config" .json)
  flags=$(seed_flags "$config") || continue
  read -ra seed <<< "$flags"  # every run starts from the same weights
  train_run "$name-1gpu" 1 "$config" "${seed[@]}"
  train_run "$name-tp2" 2 "$config" "${seed[@]}" "${tp2[@]}"
  case $name in
    llama | gla) train_run "$name-tp2-fused" 2 "$config" "${seed[@]}" "${tp2[@]}" --training.fused_cross_entropy on ;;
  esac
  [ "$name" = llama ] && train_run llama-tp2-async 2 "$config" "${seed[@]}" "${tp2[@]}" --training.compile \
    --parallelism.enable_async_tensor_parallel
done

python3 scripts/bench/compare_runs.py "$out" "tensor parallel vs 1 GPU (fp32)"

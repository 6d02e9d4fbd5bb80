#!/usr/bin/env bash
# Multi-GPU loss parity and scaling of a 340M model with `bash train.sh` (one device command per model):
#   bash scripts/bench/scale_check.sh transformer        (needs 4 GPUs; layouts that need more are skipped)
# 20 steps per layout, bf16, real documents of the builtin corpus, context 4096, $TOKENS (65536)
# tokens per data-parallel rank and step:
#   fsdp1, fsdp2, fsdp4   one varlen row per GPU (weak scaling: the same work per GPU)
#   tp2                   TP 2 x FSDP 2: the same rows as fsdp2, so the same losses
#   pp2                   PP 2 x FSDP 2, 4 microbatches of $TOKENS/4; its reference rows2 is FSDP 2
#                         on the same rows without a pipeline
#   pptp                  PP 2 x TP 2, 4 microbatches of $TOKENS/4, in fp32 (without FSDP torchtitan applies
#                         no mixed precision); its reference rows1 is 1 GPU on the same rows in fp32
#   cp2                   CP 2: fsdp1's row split over 2 GPUs, so fsdp1's losses
#   long1, cp2long        1 GPU and CP 2 on one causal sequence of 2 x $TOKENS (128K) tokens: documents
#                         concatenated without a mask (--training.no-document_mask), full AC so that
#                         1 GPU fits it, 8 steps (attention is most of the work at this length)
# CONFIG=<json> trains that config instead of configs/<model>_340M.json (e.g. a copy with another
# attn_mode; its seed is made from it). EXTRA_FLAGS="--training.mixed_precision_param float32"
# adds flags to every layout. LAYOUTS="fsdp1 tp2" runs a subset; GPUs are the visible ones
# (CUDA_VISIBLE_DEVICES), so two subsets can share a machine. Logs and metrics go to
# /tmp/flame-gpu/scale-<model>, packed after every layout into $OUT/scale-<model>.tgz
# (scripts/bench/train_run.sh); last, a table (scripts/bench/compare_runs.py): the largest
# relative loss difference from the reference, tokens/s per GPU, MFU, memory, and tokens/s per
# GPU against fsdp1 (weak-scaling efficiency).
set -uo pipefail
model=${1:?model type, e.g. transformer or gla}
out=/tmp/flame-gpu/scale-$model
mkdir -p "$out"
tokens=${TOKENS:-65536}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
layouts=" ${LAYOUTS:-fsdp1 fsdp2 fsdp4 tp2 rows2 pp2 rows1 pptp cp2 long1 cp2long} "
export FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error RUN_TIMEOUT=${RUN_TIMEOUT:-240}
# seq_len here for the seed run (train_run.sh: seed_flags), which takes only these flags; every layout sets its own
common=(--job.config_file configs/debug.toml --training.context_len 4096 --training.seq_len "$tokens" --training.steps 20 --metrics.log_freq 1
  --lr_scheduler.warmup_steps 5 --optimizer.lr 3e-4 --training.num_workers 4 --checkpoint.no-enable)
read -ra extra <<< "${EXTRA_FLAGS:-}"
common+=("${extra[@]}")
row=(--training.varlen --training.batch_size 1 --training.seq_len "$tokens")
rows4=(--training.batch_size 4 --training.seq_len $((tokens / 4)))

source scripts/bench/train_run.sh
config=${CONFIG:-configs/${model}_340M.json}
layout() { # name gpus [flags...]: train_run if selected and the machine has enough GPUs
  [[ $layouts == *" $1 "* ]] || return 0
  if [ "$2" -gt "$ngpu" ]; then echo "$1: skipped ($2 GPUs)"; return 0; fi
  local flags seed
  flags=$(seed_flags "$config") || return 1
  read -ra seed <<< "$flags"
  train_run "$1" "$2" "$config" "${seed[@]}" "${@:3}"
}

layout fsdp1 1 "${row[@]}"
layout fsdp2 2 "${row[@]}"
layout fsdp4 4 "${row[@]}"
layout tp2 4 "${row[@]}" --parallelism.tensor_parallel_degree 2
layout rows2 2 "${rows4[@]}"
layout pp2 4 "${rows4[@]}" --parallelism.pipeline_parallel_degree 2
layout rows1 1 "${rows4[@]}" --training.mixed_precision_param float32
layout pptp 4 "${rows4[@]}" --training.mixed_precision_param float32 --parallelism.pipeline_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2
layout cp2 2 "${row[@]}" --parallelism.context_parallel_degree 2
long=(--training.batch_size 1 --training.seq_len $((2 * tokens)) --training.context_len $((2 * tokens))
  --training.no-document_mask --activation_checkpoint.mode full --training.steps 8)
layout long1 1 "${long[@]}"
layout cp2long 2 "${long[@]}" --parallelism.context_parallel_degree 2

python3 scripts/bench/compare_runs.py "$out" "$model 340M: layouts vs references" --baseline fsdp1 \
  fsdp1=- fsdp2=- fsdp4=- tp2=fsdp2 rows2=- pp2=rows2 rows1=- pptp=rows1 cp2=fsdp1 long1=- cp2long=long1

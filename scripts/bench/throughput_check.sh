#!/usr/bin/env bash
# 340M throughput on one GPU, flame vs a plain PyTorch loop, same model and data (real packed
# documents of the builtin corpus, varlen rows of $TOKENS tokens, context 4096):
#   bash scripts/bench/throughput_check.sh transformer gla gated_deltanet
# Logs under $OUT; the last lines are the summary (flame's line is the mean of steps 21-30).
# RUN_TIMEOUT (default 280) seconds per run.
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}; mkdir -p "$out"
tokens=${TOKENS:-65536}
export FLAME_PYTHON=${FLAME_PYTHON:-python3} FLAME_CACHE=/tmp/flame-cache PYTHONUNBUFFERED=1
source scripts/bench/kernel_cache.sh  # the carried kernel caches; this machine's go back into $OUT at the end
for model in "$@"; do
  config=configs/${model}_340M.json
  timeout "${RUN_TIMEOUT:-280}" python3 scripts/bench/plain_loop.py --config "$config" --varlen "$tokens" --steps 20 \
    > "$out/plain_${model}.log" 2>&1
  NGPU=1 timeout "${RUN_TIMEOUT:-280}" bash train.sh --job.config_file configs/debug.toml --model.config "$config" \
    --training.varlen --training.batch_size 1 --training.seq_len "$tokens" --training.context_len 4096 \
    --training.steps 30 --metrics.log_freq 10 --lr_scheduler.warmup_steps 10 --optimizer.lr 3e-4 \
    --training.num_workers 4 --checkpoint.no-enable --job.dump_folder "/tmp/flame-bench-$model" \
    > "$out/flame_${model}.log" 2>&1
  echo "flame $model: exit $?"
done
echo "=== summary ==="
for model in "$@"; do
  grep plain-loop "$out/plain_${model}.log" || tail -3 "$out/plain_${model}.log"
  grep -E "step +30/30" "$out/flame_${model}.log" | sed 's/\x1b\[[0-9;]*m//g' | sed "s/.*INFO - /flame $model: /"
done
if [ -n "${OUT:-}" ]; then kernel_cache_save; fi

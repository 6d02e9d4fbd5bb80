#!/usr/bin/env bash
# The trainer's GPU checks, as one device run (logs under $OUT, a summary table last):
#   1. the embedded default job (`bash train.sh`) on the GPU
#   2. tests/gpu (single-GPU bf16 run; 2-GPU FSDP/NCCL run when 2 GPUs are visible)
#   3. throughput at 340M (llama, 4 x 4096 tokens): a plain PyTorch loop vs flame
# Expects the environment prepared (PYTHONPATH with flame's extra wheels).
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}
mkdir -p "$out"
export FLAME_PYTHON=${FLAME_PYTHON:-python3} FLAME_CACHE=/tmp/flame-cache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L

bash train.sh > "$out/default_job.log" 2>&1
echo "default job: exit $?"
grep -E "step +(1|100|200|300)/300" "$out/default_job.log" | sed 's/\x1b\[[0-9;]*m//g' | sed 's/.*INFO - //'
grep -A2 "^sample from" "$out/default_job.log"

python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1
echo "tests/gpu: exit $? ($(tail -1 "$out/gpu_tests.log"))"

if [ "${1:-}" != "--no-bench" ]; then
  python3 scripts/bench/plain_loop.py --config configs/llama_340M.json --batch 4 --seq 4096 --steps 20 \
    > "$out/plain_340M.log" 2>&1
  NGPU=1 bash train.sh --job.config_file configs/debug.toml --model.config configs/llama_340M.json \
    --training.seq_len 4096 --training.batch_size 4 --training.steps 40 --metrics.log_freq 10 \
    --lr_scheduler.warmup_steps 10 --optimizer.lr 3e-4 --training.num_workers 4 --checkpoint.no-enable \
    --job.dump_folder /tmp/flame-bench-340M > "$out/flame_340M.log" 2>&1
  echo "flame 340M: exit $?"
fi
echo "=== summary ($ngpu GPU) ==="
grep plain-loop "$out/plain_340M.log" 2>/dev/null
grep -E "step +40/40" "$out/flame_340M.log" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | sed 's/.*INFO - /flame 340M: /'

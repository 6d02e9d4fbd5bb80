#!/usr/bin/env bash
# Data loader throughput on the GPU machine's CPUs (logs under $OUT): flame.data.bench on the
# builtin corpus at 8 x 4096 tokens per batch, for 0..16 workers; then the default job.
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}
mkdir -p "$out"
export FLAME_PYTHON=${FLAME_PYTHON:-python3} FLAME_CACHE=/tmp/flame-cache PYTHONUNBUFFERED=1
echo "cpus: $(nproc)"
python3 -m flame.data.bench --workers 0,1,4,8,16 --batches 300 -- --job.config_file configs/debug.toml \
  --training.seq_len 4096 --training.batch_size 8 > "$out/loader_bench.log" 2>&1
echo "loader bench: exit $?"
tail -6 "$out/loader_bench.log"
bash train.sh > "$out/default_job.log" 2>&1
echo "default job: exit $?"
grep -E "step +(1|300)/300" "$out/default_job.log" | sed 's/\x1b\[[0-9;]*m//g;s/.*INFO - //'

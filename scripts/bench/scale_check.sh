#!/usr/bin/env bash
# Multi-GPU scaling of a 340M model with `bash train.sh` (one device command per model):
#   bash scripts/bench/scale_check.sh transformer        (needs 4 GPUs; layouts that need more are skipped)
# Layouts, 20 steps each, real packed documents of the builtin corpus, context 4096:
#   fsdp1, fsdp2, fsdp4   varlen rows of $TOKENS tokens per GPU (weak scaling: same work per GPU)
#   tp2                   TP 2 x FSDP 2 (4 GPUs: without FSDP, TP would train in fp32), varlen
#   pp2                   PP 2 x FSDP 2 (4 GPUs), 4 rows of $TOKENS/4 per data-parallel rank
#   cp2                   CP 2 (FSDP over the CP ranks), varlen rows of 2 x $TOKENS tokens
# Logs and metrics under $OUT/scale; last, a table: tokens/s per GPU, MFU, memory, the loss at
# steps 10 and 20, and weak-scaling efficiency against fsdp1.
set -uo pipefail
model=${1:?model type, e.g. transformer or gla}
out=${OUT:-/tmp/flame-gpu}/scale
mkdir -p "$out"
tokens=${TOKENS:-65536}
ngpu=$(nvidia-smi -L | wc -l)
export FLAME_PYTHON=${FLAME_PYTHON:-python3} FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRANSFORMERS_VERBOSITY=error
common=(--job.config_file configs/debug.toml --model.config "configs/${model}_340M.json" --training.context_len 4096
  --training.steps 20 --metrics.log_freq 10 --lr_scheduler.warmup_steps 5 --optimizer.lr 3e-4 --training.num_workers 4
  --checkpoint.no-enable)
varlen=(--training.varlen --training.batch_size 1)

run() { # name gpus [flags...]
  local name=$1 gpus=$2
  shift 2
  if [ "$gpus" -gt "$ngpu" ]; then echo "$name: skipped ($gpus GPUs)"; return; fi
  rm -rf "${out:?}/$name"
  NGPU=$gpus timeout 300 bash train.sh "${common[@]}" --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}

run fsdp1 1 "${varlen[@]}" --training.seq_len "$tokens"
run fsdp2 2 "${varlen[@]}" --training.seq_len "$tokens"
run fsdp4 4 "${varlen[@]}" --training.seq_len "$tokens"
run tp2 4 "${varlen[@]}" --training.seq_len "$tokens" --parallelism.tensor_parallel_degree 2
run pp2 4 --training.batch_size 4 --training.seq_len $((tokens / 4)) --parallelism.pipeline_parallel_degree 2
run cp2 2 "${varlen[@]}" --training.seq_len $((2 * tokens)) --parallelism.context_parallel_degree 2

python3 - "$out" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
rows = {}
for run in ("fsdp1", "fsdp2", "fsdp4", "tp2", "pp2", "cp2"):
    path = out / run / "metrics.jsonl"
    if path.is_file():
        rows[run] = {json.loads(l)["step"]: json.loads(l) for l in path.read_text().splitlines()}
base = rows.get("fsdp1", {}).get(20, {}).get("throughput(tps)")
print(f"{'layout':8s} {'tok/s/GPU':>10s} {'MFU':>6s} {'mem GiB':>8s} {'loss@10':>8s} {'loss@20':>8s} {'vs fsdp1':>8s}")
for run, steps in rows.items():
    last = steps.get(20)
    if not last:
        print(f"{run:8s} (no step 20: see {out / run}.log)")
        continue
    tps = last["throughput(tps)"]
    mfu = 100 * (last.get("tflops") or 0) / 989
    mem = last.get("memory/max_reserved(GiB)") or 0
    eff = f"{100 * tps / base:.0f}%" if base else ""
    loss10 = steps.get(10, {}).get("loss_metrics/global_avg_loss", float("nan"))
    print(f"{run:8s} {tps:10,.0f} {mfu:6.1f} {mem:8.1f} {loss10:8.3f} {last['loss_metrics/global_avg_loss']:8.3f} {eff:>8s}")
PY

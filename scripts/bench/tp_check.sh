#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs against 1 GPU, in fp32 so that the loss curves agree to rounding:
#   bash scripts/bench/tp_check.sh [config ...]    default: configs/tiny/{transformer,gla,gsa,delta_net,mamba2,llama}.json
# Each config trains STEPS (default 10) steps with `bash train.sh` on 1 GPU and with NGPU=2
# --parallelism.tensor_parallel_degree 2 (logits + CE under loss_parallel); llama and gla also
# with the fused loss; llama also with async TP (compiled blocks). Logs and metrics under
# $OUT/tp; last, one line per run: its losses and the largest relative difference from 1 GPU.
# About 30-60 s per run: pass fewer configs to stay within one device command.
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}/tp
mkdir -p "$out"
steps=${STEPS:-10}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/{transformer,gla,gsa,delta_net,mamba2,llama}.json)
export FLAME_CACHE=${FLAME_CACHE:-/tmp/flame-cache} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
# fp32 on both sides: without FSDP, torchtitan runs TP without mixed precision
common=(--job.config_file configs/debug.toml --training.steps "$steps" --metrics.log_freq 1 --checkpoint.no-enable
  --lr_scheduler.warmup_steps 2 --training.mixed_precision_param float32)
tp2=(--parallelism.tensor_parallel_degree 2)

run() { # name ngpu config [flags...]
  local name=$1 ngpu=$2 config=$3
  shift 3
  rm -rf "${out:?}/$name"
  NGPU=$ngpu timeout 500 bash train.sh "${common[@]}" --model.config "$config" --job.dump_folder "$out/$name" "$@" \
    > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}

for config in "${configs[@]}"; do
  name=$(basename "$config" .json)
  run "$name-1gpu" 1 "$config"
  run "$name-tp2" 2 "$config" "${tp2[@]}"
  case $name in
    llama | gla) run "$name-tp2-fused" 2 "$config" "${tp2[@]}" --training.fused_cross_entropy on ;;
  esac
  [ "$name" = llama ] && run llama-tp2-async 2 "$config" "${tp2[@]}" --training.compile \
    --parallelism.enable_async_tensor_parallel
done

python3 - "$out" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])

def curve(name):
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = {json.loads(line)["step"]: json.loads(line) for line in path.read_text().splitlines()}
    return {step: row["loss_metrics/global_avg_loss"] for step, row in sorted(rows.items())}

print("=== tensor parallel vs 1 GPU (fp32) ===")
for run in sorted(p.name for p in out.iterdir() if p.is_dir()):
    base = run.split("-")[0]
    got, ref = curve(run), curve(f"{base}-1gpu")
    if got is None:
        print(f"{run:28s} no metrics (see {out / run}.log)")
        continue
    diff = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in got if s in ref), default=float("nan")) if ref else float("nan")
    losses = " ".join(f"{v:.4f}" for v in got.values())
    print(f"{run:28s} max rel diff {diff:.1e}  losses {losses}")
PY

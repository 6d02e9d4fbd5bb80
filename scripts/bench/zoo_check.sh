#!/usr/bin/env bash
# Every model config under configs/tiny on the GPU, eager (with varlen parity) or --compile:
# `bash scripts/bench/zoo_check.sh [--compile] [config ...]`; one JSON line per config in
# $OUT/zoo[-compile].jsonl. Four processes share the GPU (tiny models; tokens/s is indicative).
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}; mkdir -p "$out"
mode=""; [ "${1:-}" = "--compile" ] && { mode="--compile"; shift; }
configs=("$@"); [ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/*.json)
export FLAME_CACHE=/tmp/flame-cache PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
python3 -c "from flame.data import builtin; builtin.resolve('builtin:python-stdlib'); builtin.resolve('builtin:python-stdlib-bpe')"
log="$out/zoo${mode:+-compile}.jsonl"
run_one() {  # config -> one JSON line (or an error line when it timed out or crashed)
  local line
  line=$(timeout 240 python3 scripts/bench/model_zoo.py "$1" $mode 2>>"$out/zoo-stderr.log" | tail -1)
  [ -n "$line" ] || line="{\"config\": \"$1\", \"error\": \"timeout or crash (see zoo-stderr.log)\"}"
  echo "$line" >> "$log"
}
export -f run_one; export out mode log
printf '%s\n' "${configs[@]}" | xargs -P 4 -I{} bash -c 'run_one {}'
python3 - "$log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(f"{r['config']:42s} ERROR {r['error'][:150]}")
    else:
        print(f"{r['config']:42s} trains={r['trains']} loss {r['loss_first']:.2f}->{r['loss_last']:.2f} "
              f"parity={r.get('parity_logits', float('nan')):.4f}/{r.get('parity_grads', float('nan')):.4f} "
              f"tok/s={r['tokens_per_s']:,.0f} mem={r['peak_mem_gib']:.2f}GiB recompiles={r.get('graphs_compiled_after_step5', '-')}")
PY

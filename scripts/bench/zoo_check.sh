#!/usr/bin/env bash
# Every model config under configs/tiny on the GPU: varlen parity, eager and compiled training
# (`bash scripts/bench/zoo_check.sh [--no-compile] [config ...]`); one JSON line per config in
# $OUT/zoo.jsonl. ZOO_JOBS (default 4) processes share the GPU (tiny models; tokens/s is indicative);
# ZOO_TIMEOUT (default 400) seconds per config; ZOO_ARGS more model_zoo.py options, e.g.
# "--steps 8 --tokens 512" for mamba and samba, whose layers scan token by token without mamba_ssm
# (8 steps of 1024 tokens did not finish within 300 s on an H200).
set -uo pipefail
out=${OUT:-/tmp/flame-gpu}; mkdir -p "$out"
mode=""; [ "${1:-}" = "--no-compile" ] && { mode="--no-compile"; shift; }
configs=("$@"); [ ${#configs[@]} -eq 0 ] && configs=(configs/tiny/*.json)
export FLAME_CACHE=/tmp/flame-cache PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
source scripts/bench/kernel_cache.sh  # the carried kernel caches; this machine's go back into $OUT at the end
python3 -c "from flame.data import builtin; builtin.resolve('builtin:python-stdlib'); builtin.resolve('builtin:python-stdlib-bpe')"
log="$out/zoo.jsonl"
run_one() {  # config -> one JSON line: model_zoo.py's last (it prints one after every stage)
  local line
  line=$(timeout "${ZOO_TIMEOUT:-400}" python3 scripts/bench/model_zoo.py "$1" $mode ${ZOO_ARGS:-} 2>>"$out/zoo-stderr.log" | tail -1)
  [ -n "$line" ] || line="{\"config\": \"$1\", \"done\": \"nothing\"}"
  echo "$line" >> "$log"
}
export -f run_one; export out mode log
printf '%s\n' "${configs[@]}" | xargs -P "${ZOO_JOBS:-4}" -I{} bash -c 'run_one {}'
python3 - "$log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    parts = []
    for mode in ("eager", "compile"):
        if mode in r:
            m = r[mode]
            extra = f" recompiles={m['graphs_compiled_after_step5']}" if mode == "compile" else ""
            parts.append(f"{mode}: trains={m['trains']} loss {m['loss_first']:.2f}->{m['loss_last']:.2f} "
                         f"tok/s={m['tokens_per_s']:,.0f} mem={m['peak_mem_gib']:.2f}GiB{extra}")
    if "parity_logits" in r:
        parts.insert(0, f"parity={r['parity_logits']:.4f}/{r['parity_grads']:.4f}")
    if "error" in r:
        parts.append(f"ERROR {r['error'][:150]}")
    elif r.get("done", "all") != "all":  # killed at ZOO_TIMEOUT (or crashed) after that stage
        parts.append(f"ERROR timeout or crash after stage {r['done']} (see zoo-stderr.log)")
    print(f"{r['config']:42s} " + " | ".join(parts))
PY
if [ -n "${OUT:-}" ]; then kernel_cache_save; fi

#!/usr/bin/env bash
# flame launcher.
#
#   bash train.sh                        the embedded default job (configs/debug.toml): trains a
#                                        small llama on the Python stdlib, exports it, prints a sample
#   bash train.sh --job.config_file flame/models/flame.toml --training.steps 100 ...
#   bash train.sh -h                     every option, with help
#
# Environment:
#   NGPU         processes per node (default: the visible GPUs, or 1 on a machine without GPU)
#   NNODE        nodes (default 1); NODE_RANK this node's rank (default 0)
#   MASTER_ADDR, MASTER_PORT   rendezvous of a multi-node run (node 0's address, default port 29500)
#   LOG_RANK     local ranks whose output shows on the console (default 0; all ranks log to files)
#   FLAME_PYTHON use this interpreter as it is instead of the managed .venv (see 3rdparty/install.sh)
#
# Per-rank logs go to <dump_folder>/logs. After a successful run with checkpoints, node 0
# exports the latest checkpoint as a Hugging Face model to <dump_folder>/hf.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=$(bash "$root/3rdparty/install.sh") || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

for arg in "$@"; do
  case $arg in -h | --help) exec "$python" -m flame.train "$@" ;; esac
done

export_args=()
if [ $# -eq 0 ]; then
  echo "flame: no arguments, running the embedded default job (configs/debug.toml)"
  set -- --job.config_file "$root/configs/debug.toml"
  export_args=(--sample "def __init__(self")
fi

NGPU=${NGPU:-$("$python" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
NNODE=${NNODE:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}

plan=$(mktemp)
trap 'rm -f "$plan"' EXIT
"$python" -m flame.launch --world-size $((NGPU * NNODE)) --env-file "$plan" -- "$@" || exit $?
# shellcheck disable=SC1090
source "$plan" # FLAME_DUMP_FOLDER, FLAME_CHECKPOINT

if [ "$NNODE" -gt 1 ]; then
  rendezvous=(--nnodes "$NNODE" --node_rank "$NODE_RANK"
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR to node 0 for a multi-node run}" --master_port "${MASTER_PORT:-29500}")
else
  rendezvous=(--standalone)
fi
mkdir -p "$FLAME_DUMP_FOLDER/logs"
"$python" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$NGPU" \
  --log-dir "$FLAME_DUMP_FOLDER/logs" --redirects 3 --tee 3 --local-ranks-filter "$LOG_RANK" \
  -m flame.train "$@"
status=$?
if [ $status -ne 0 ]; then
  echo "flame: training failed (exit $status); per-rank logs are in $FLAME_DUMP_FOLDER/logs" >&2
  exit $status
fi

if [ "$FLAME_CHECKPOINT" = 1 ] && [ "$NODE_RANK" = 0 ]; then
  "$python" -m flame.utils.convert_dcp_to_hf --path "$FLAME_DUMP_FOLDER" "${export_args[@]}" || exit $?
elif [ "$FLAME_CHECKPOINT" != 1 ]; then
  echo "flame: checkpoints are off (--checkpoint.enable), so there is nothing to export to HF"
fi

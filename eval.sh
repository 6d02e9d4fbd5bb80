#!/usr/bin/env bash
# lm-eval of a flame model on every visible GPU (data parallel: each process scores its share of the requests).
#
#   NGPU=8 bash eval.sh --model exp/run [--step N] --tasks piqa,hellaswag --batch_size 64 [lm-eval's options]
#   bash eval.sh -h        flame.eval's options, then lm-eval's
#
# NGPU: processes (default: the visible GPUs; 1 on a machine without GPU, which scores on the CPU).
# The same as `torchrun --standalone --nproc_per_node $NGPU -m flame.eval ...` (docs/evaluation.md).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=$(bash "$root/3rdparty/install.sh") || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$python" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
if [[ ! $NGPU =~ ^[1-9][0-9]*$ ]]; then
  echo "flame.eval: error: NGPU must be a whole number >= 1, not '$NGPU'" >&2
  exit 2
fi
if [ "$NGPU" = 1 ]; then
  exec "$python" -m flame.eval "$@"
fi
exec "$python" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m flame.eval "$@"

#!/usr/bin/env bash
# flame's launcher: what `flame train` (an installed flame) and `bash train.sh` (a checkout) run.
#
#   flame train                          the embedded default job (configs/debug.toml): trains a
#                                        small llama on the Python stdlib, exports it, prints a sample
#   flame train --job.config_file configs/fla.toml --training.steps 100 ...   (fla.toml = flame.toml)
#   flame train -h                       every option, with help
#
# Environment:
#   FLAME_PYTHON the interpreter that has flame (set by `flame train` and the checkout's train.sh)
#   FLAME_COMMAND how the user started it ("flame train" or "bash train.sh"), for the resume line
#   NGPU         processes per node (default: the visible GPUs, or 1 on a machine without GPU)
#   NNODE        nodes (default 1); NODE_RANK this node's rank (default 0)
#   MASTER_ADDR, MASTER_PORT   rendezvous of a multi-node run: node 0's address and a free port
#                (default 29500) where node 0 hosts torchrun's c10d rendezvous
#   LOG_RANK     local ranks whose output shows on the console (default 0; all ranks log to files)
#   FLAME_DRY_RUN=1  check the job, print the launch command this node would run, start nothing
#   FLAME_CACHE  where the built-in corpus and tokenizer are built (default ~/.cache/flame)
#   TRITON_CACHE_AUTOTUNING  default 1: fla's kernels autotune once per machine, then read the choice
#   FLAME_DUMP_STACKS_AFTER  seconds: every rank prints its Python stacks to its stderr.log once,
#                that long after train.sh started, and goes on (for where SIGUSR2 does not reach the
#                ranks). faulthandler reads a busy rank's frames while they change and can crash it,
#                so set it just before a point where you would stop the run anyway
#
# A run that seems stuck: pkill -USR2 '^flame-rank' makes every rank
# print its Python stacks to its stderr.log and go on.
#
# Multi-node: run train.sh on every node with the same arguments and its NODE_RANK. Inside a
# Slurm job step (SLURM_JOB_ID set; run once per node: srun --ntasks-per-node=1, as
# scripts/slurm/train.sbatch does) NNODE, NODE_RANK, MASTER_ADDR, MASTER_PORT and NGPU default to
# the step's nodes, node id, first host, a port derived from the job id and SLURM_GPUS_ON_NODE.
#
# Per-rank logs go to <dump_folder>/logs (<dump_folder>/logs/node<NODE_RANK> on several nodes).
# After a successful run with checkpoints, node 0 exports the latest checkpoint as a Hugging
# Face model to <dump_folder>/hf.
#
# One run per dump folder: node 0 holds <dump_folder>/.flame.lock from the start to the end of
# the export; a second run there is refused in one line naming the holder, and the lock of a run
# that died is taken over with a warning. The run's processes end with this script, however it
# ends (kill -9 too): torchrun's agent gets SIGTERM and stops the ranks, a rank whose agent is
# gone gets SIGKILL (flame/launch/supervise.py). Each start is an attempt: its job config goes to
# <dump_folder>/attempts/<n>/ and <dump_folder>/job_config.json, its metrics.jsonl lines name it.
set -uo pipefail
unset FLAME_DUMP_STACKS_AT # set here only: the ranks start after the preflight, so a time, not a delay
if [ -n "${FLAME_DUMP_STACKS_AFTER:-}" ]; then
  if [[ ! $FLAME_DUMP_STACKS_AFTER =~ ^[1-9][0-9]*$ ]]; then
    echo "flame: error: FLAME_DUMP_STACKS_AFTER must be a whole number of seconds, not '$FLAME_DUMP_STACKS_AFTER'" >&2
    exit 2
  fi
  export FLAME_DUMP_STACKS_AT=$(($(date +%s) + FLAME_DUMP_STACKS_AFTER))
fi
python=${FLAME_PYTHON:?run flame train, or bash train.sh in a checkout: they set FLAME_PYTHON}
export FLAME_COMMAND=${FLAME_COMMAND:-flame train} PYTHONUNBUFFERED=1
# fla's autotuning takes minutes on a new machine; cached, a resumed run starts at once
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}

for arg in "$@"; do
  case $arg in -h | --help) exec "$python" -m flame.train "$@" ;; esac
done

export_args=()
if [ $# -eq 0 ]; then
  echo "flame: no arguments, running the embedded default job (configs/debug.toml)"
  set -- --job.config_file configs/debug.toml # flame's shipped file, found from any directory
  export_args=(--sample "def __init__(self")
fi

if [ -n "${SLURM_JOB_ID:-}" ]; then # what the user did not set comes from the Slurm step
  slurm=$("$python" -m flame.launch.slurm) || exit $?
  eval "$slurm"
fi
if [ -z "${NGPU:-}" ]; then # the visible GPUs: nvidia-smi answers in a fraction of torch's import
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && command -v nvidia-smi > /dev/null && gpus=$(nvidia-smi -L 2> /dev/null); then
    NGPU=$(grep -c '^GPU ' <<< "$gpus")
  else # CUDA_VISIBLE_DEVICES has forms (UUIDs, MIG) only CUDA itself counts right
    NGPU=$("$python" -c 'import torch; print(torch.cuda.device_count())')
  fi
  [ "$NGPU" -ge 1 ] 2> /dev/null || NGPU=1
fi
NNODE=${NNODE:-1}
NODE_RANK=${NODE_RANK:-0}
for name in NGPU NNODE NODE_RANK; do # shell arithmetic below would fail with a bare shell error
  least=1
  [ "$name" = NODE_RANK ] && least=0
  if [[ ! ${!name} =~ ^[0-9]+$ ]] || [ "${!name}" -lt "$least" ]; then
    echo "flame: error: $name must be a whole number >= $least, not '${!name}'" >&2
    exit 2
  fi
done
if [ "$NODE_RANK" -ge "$NNODE" ]; then
  echo "flame: error: NODE_RANK $NODE_RANK is not below NNODE $NNODE: number the nodes 0 to $((NNODE - 1))" >&2
  exit 2
fi
LOG_RANK=${LOG_RANK:-0}
if [[ ! $LOG_RANK =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "flame: error: LOG_RANK must be local ranks below NGPU $NGPU, comma-separated (e.g. 0 or 0,1), not '$LOG_RANK'" >&2
  exit 2
fi
for rank in ${LOG_RANK//,/ }; do
  if [ "$rank" -ge "$NGPU" ]; then
    echo "flame: error: LOG_RANK $rank is not a local rank: NGPU $NGPU runs local ranks 0 to $((NGPU - 1)) on each node" >&2
    exit 2
  fi
done
if [ -n "${MASTER_PORT:-}" ] && { [[ ! $MASTER_PORT =~ ^[0-9]{1,5}$ ]] || [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; }; then
  echo "flame: error: MASTER_PORT must be a free port number (1-65535) on node 0, not '$MASTER_PORT'" >&2
  exit 2
fi
if [ "$NNODE" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  echo "flame: error: a run on $NNODE nodes (NNODE) needs MASTER_ADDR, the address of node 0, on every node" >&2
  exit 2
fi

if [ "$NNODE" -gt 1 ]; then
  # c10d rendezvous, hosted by node 0 (explicitly: MASTER_ADDR may be an address its hostname
  # does not resolve to); torchrun numbers the nodes itself, so NODE_RANK only picks the host
  rendezvous=(--nnodes "$NNODE" --rdzv_backend c10d --rdzv_id "${SLURM_JOB_ID:-flame}"
    --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR to node 0 for a multi-node run}:${MASTER_PORT:-29500}"
    --rdzv_conf "is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
else
  rendezvous=(--standalone)
fi
# flame.launch.supervise checks the job, then runs torchrun's agent tied to this script (the ranks' logs
# in <dump_folder>/logs), and on node 0 holds the dump folder's lock for the run and the export
launch=("$python" -m flame.launch.supervise --world-size $((NGPU * NNODE)) --nodes "$NNODE" --node-rank "$NODE_RANK")
[ "${FLAME_DRY_RUN:-0}" = 1 ] && launch+=(--dry-run)
launch+=("${export_args[@]}" -- "${rendezvous[@]}" --nproc_per_node "$NGPU" --redirects 3 --tee 3
  --local-ranks-filter "$LOG_RANK" -m flame.train "$@")
# A stop signal to this script's whole process group (Slurm's SIGTERM, a terminal's Ctrl-C) must not end it
# before the launcher, whose run saves a checkpoint first and would read this script's exit as a second
# signal (flame.training.stop): the trap outlives the signal and lets the launcher's status through.
trap ':' TERM INT HUP USR1
trap '' USR2 # the ranks' stack dumps (pkill -USR2 '^flame-rank'); sent to the whole group, it ends nothing
FLAME_PARENT_PID=$$ "${launch[@]}" # its own messages say what failed

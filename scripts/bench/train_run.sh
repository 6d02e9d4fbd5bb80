# Sourced by the GPU check scripts: `train_run name ngpu config [flags...]` trains with
# `bash train.sh "${common[@]}"` plus the flags, into $out/<name> (log: $out/<name>.log).
# Only the log and metrics.jsonl stay; after a failure, every rank's stderr is kept as
# $out/<name>.rank<N>.err (at the time limit, RUN_TIMEOUT seconds (default 500), with every
# rank's Python stacks). With $OUT set (a device-tool run, which returns few files), $out is
# packed after every run into $OUT/<basename of $out>.tgz, so what finished comes back, and so
# are the machine's kernel caches (scripts/bench/kernel_cache.sh, which unpacks the carried ones).
source scripts/bench/kernel_cache.sh

# Every layout of a comparison starts from the same weights: seed_flags makes a seed checkpoint of a
# config once, in one process (--checkpoint.create_seed_checkpoint), and returns the flags that load
# it. Without it, GPU layouts start from different draws: DTensor's RNG gives sharded weights other
# values than one GPU's init, so curves could agree only statistically, even in fp32.
seeds=/tmp/flame-seeds  # outside $out: a 340M seed with its optimizer state is 4 GB
seed_flags() {  # config -> flags for train_run
  local seed="$seeds/$(basename "$1" .json)"
  mkdir -p "$seeds"
  if [ ! -d "$seed/checkpoint/step-0" ]; then
    NGPU=1 bash train.sh "${common[@]}" --model.config "$1" --job.dump_folder "$seed" --checkpoint.enable \
      --checkpoint.create_seed_checkpoint > "$seed.log" 2>&1 || { echo "seed of $1 failed: $seed.log" >&2; return 1; }
  fi
  echo --checkpoint.enable --checkpoint.load_only --checkpoint.initial_load_path "$seed/checkpoint/step-0"
}

train_run() {
  local name=$1 ngpu=$2 config=$3 status
  shift 3
  rm -rf "${out:?}/$name"
  local limit=${RUN_TIMEOUT:-500}
  # 15 s before the limit, every rank of this run prints its Python stacks, so a run that hangs
  # shows where each rank waits in its stderr (kept below). A timer, not SIGUSR1: on the H200
  # machines the ranks' main processes printed nothing on SIGUSR1.
  FLAME_DUMP_STACKS_AFTER=$((limit - 15)) NGPU=$ngpu timeout "$limit" bash train.sh "${common[@]}" --model.config "$config" \
    --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1
  status=$?
  echo "$name: exit $status"
  if [ $status -ne 0 ]; then
    for err in "$out/$name"/logs/*/attempt_*/*/stderr.log; do
      [ -s "$err" ] && cp "$err" "$out/$name.rank$(basename "$(dirname "$err")").err"
    done
  fi
  find "$out/$name" -mindepth 1 -maxdepth 1 ! -name metrics.jsonl -exec rm -rf {} +
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/$(basename "$out").tgz" -C "$out" .
    kernel_cache_save
  fi
  return $status
}

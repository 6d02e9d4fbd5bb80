# Sourced by the GPU check scripts: `train_run name ngpu config [flags...]` trains with
# `bash train.sh "${common[@]}"` plus the flags, into $out/<name> (log: $out/<name>.log).
train_run() {
  local name=$1 ngpu=$2 config=$3
  shift 3
  rm -rf "${out:?}/$name"
  NGPU=$ngpu timeout "${RUN_TIMEOUT:-500}" bash train.sh "${common[@]}" --model.config "$config" \
    --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"
}

# Sourced by the GPU check scripts: `train_run name ngpu config [flags...]` trains with
# `bash train.sh "${common[@]}"` plus the flags, into $out/<name> (log: $out/<name>.log).
# Only the log and metrics.jsonl stay (the device tool returns a limited number of files);
# after a failure, every rank's stderr is kept as $out/<name>.rank<N>.err.
train_run() {
  local name=$1 ngpu=$2 config=$3 status
  shift 3
  rm -rf "${out:?}/$name"
  NGPU=$ngpu timeout "${RUN_TIMEOUT:-500}" bash train.sh "${common[@]}" --model.config "$config" \
    --job.dump_folder "$out/$name" "$@" > "$out/$name.log" 2>&1
  status=$?
  echo "$name: exit $status"
  if [ $status -ne 0 ]; then
    for err in "$out/$name"/logs/*/attempt_*/*/stderr.log; do
      [ -s "$err" ] && cp "$err" "$out/$name.rank$(basename "$(dirname "$err")").err"
    done
  fi
  find "$out/$name" -mindepth 1 -maxdepth 1 ! -name metrics.jsonl -exec rm -rf {} +
  return $status
}

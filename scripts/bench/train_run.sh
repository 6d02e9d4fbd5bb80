# Sourced by the GPU check scripts: `train_run name ngpu config [flags...]` trains with
# `bash train.sh "${common[@]}"` plus the flags, into $out/<name> (log: $out/<name>.log).
# Only the log and metrics.jsonl stay; after a failure, every rank's stderr is kept as
# $out/<name>.rank<N>.err. With $OUT set (a device-tool run, which returns few files), $out is
# packed after every run into $OUT/<basename of $out>.tgz, so what finished comes back.
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
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/$(basename "$out").tgz" -C "$out" .; fi
  return $status
}

# fla's kernels tune and compile on a fresh GPU machine for minutes before step 1 (docs/perf-log.md,
# sessions 10-15). Each machine caches the results; .kernel-cache/ (gitignored, carried to the
# device) takes two of them from one device call to the next:
#   autotune.tgz    Triton's autotune choices (*.autotune.json, kept with TRITON_CACHE_AUTOTUNING=1)
#   tlcache.tgz     TileLang's compiled kernels (the gated delta-rule family's backward on Hopper)
# Triton's and inductor's compiled kernels are not carried: a 340M gla run's came to 47 MiB packed
# with xz (90 MiB for TP 2 and PP 2), over the 16 MiB a returned file may have and the room left
# in a call's 64 MiB of carried files (session 15). So a fresh machine still compiles for minutes.
# On the device, sourcing this file (from the repository root) unpacks the carried caches, once
# per machine, and `kernel_cache_save` packs the machine's into $OUT. Here, after a device call,
# merge what came back into .kernel-cache/:
#   bash scripts/bench/kernel_cache.sh merge <the call's files_at folder>
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
export TRITON_CACHE_AUTOTUNING=1 TILELANG_CACHE_DIR=/tmp/tlcache  # tlcache.tgz holds tlcache/, unpacked in /tmp

kernel_cache_restore() {  # folder holding the archives; once per machine
  # Every bench script sources this file, also while others train: unpacking again would replace
  # cache files that running jobs may be reading.
  local done_marker=/tmp/.flame-kernel-cache-restored
  [ -f "$done_marker" ] && return 0
  touch "$done_marker"
  mkdir -p "$triton_cache"
  [ -f "$1/autotune.tgz" ] && tar xzf "$1/autotune.tgz" -C "$triton_cache"
  [ -f "$1/tlcache.tgz" ] && tar xzf "$1/tlcache.tgz" -C /tmp
  return 0
}

kernel_cache_save() {  # this machine's caches -> $OUT
  (cd "$triton_cache" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
  [ -d "$TILELANG_CACHE_DIR" ] && tar czf "$OUT/tlcache.tgz" -C /tmp tlcache
  return 0
}

kernel_cache_merge() {  # folder of a device call's files -> .kernel-cache/ (the union with what is there)
  local from=$1 union archive
  mkdir -p .kernel-cache
  union=$(mktemp -d)
  for archive in autotune.tgz tlcache.tgz; do
    [ -f "$from/$archive" ] || continue
    mkdir -p "$union/$archive"
    [ -f ".kernel-cache/$archive" ] && tar xzf ".kernel-cache/$archive" -C "$union/$archive"
    tar xzf "$from/$archive" -C "$union/$archive"
    tar czf ".kernel-cache/$archive" -C "$union/$archive" .
  done
  rm -rf "$union"
  du -sh .kernel-cache/* | sed 's/^/kernel cache: /'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  [ "${1:-}" = merge ] && [ -d "${2:-}" ] || { echo "usage: bash $0 merge <folder of a device call's files>" >&2; exit 2; }
  kernel_cache_merge "$2"
else
  kernel_cache_restore .kernel-cache
fi

# fla's kernels tune and compile on a fresh GPU machine for minutes before step 1 (docs/perf-log.md,
# sessions 10-14). Each machine caches the results; .kernel-cache/ (gitignored, carried to the
# device) takes them from one device call to the next:
#   autotune.tgz    Triton's autotune choices (*.autotune.json, kept with TRITON_CACHE_AUTOTUNING=1)
#   tlcache.tgz     TileLang's compiled kernels (the gated delta-rule family's backward on Hopper)
#   kernels.tar.xz  Triton's and inductor's compiled kernels: carried autotune choices alone do
#                   not save a fresh machine's work (gated_deltanet 340M: step 1 after 3 min 49 s
#                   with every choice carried, after 3 s on a machine that had run it)
# On the device, sourcing this file (from the repository root) unpacks them, and
# `kernel_cache_save` packs the machine's caches into $OUT: three of the eight files a call
# returns, kernels.tar.xz only while it fits the 16 MiB a returned file may have.
# Here, after a device call, merge what came back into .kernel-cache/:
#   bash scripts/bench/kernel_cache.sh merge <the call's files_at folder>
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
inductor_cache=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
export TRITON_CACHE_AUTOTUNING=1 TILELANG_CACHE_DIR=/tmp/tlcache  # tlcache.tgz holds tlcache/

kernel_cache_restore() {  # folder holding the archives
  mkdir -p "$triton_cache" "$inductor_cache"
  [ -f "$1/autotune.tgz" ] && tar xzf "$1/autotune.tgz" -C "$triton_cache"
  [ -f "$1/tlcache.tgz" ] && tar xzf "$1/tlcache.tgz" -C /tmp
  if [ -f "$1/kernels.tar.xz" ]; then  # triton/ and inductor/ inside
    local unpacked
    unpacked=$(mktemp -d)
    tar xJf "$1/kernels.tar.xz" -C "$unpacked"
    cp -a "$unpacked/triton/." "$triton_cache/" 2>/dev/null
    cp -a "$unpacked/inductor/." "$inductor_cache/" 2>/dev/null
    rm -rf "$unpacked"
  fi
  return 0
}

_pack_kernels() {  # -> kernels.tar.xz of both caches (as triton/ and inductor/) on stdout
  local stage names=()
  stage=$(mktemp -d)
  [ -d "$triton_cache" ] && ln -s "$triton_cache" "$stage/triton" && names+=(triton)
  [ -d "$inductor_cache" ] && ln -s "$inductor_cache" "$stage/inductor" && names+=(inductor)
  tar chf - -C "$stage" "${names[@]}" | xz -T0 -6
  rm -rf "$stage"
}

kernel_cache_save() {  # this machine's caches -> $OUT
  (cd "$triton_cache" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
  [ -d "$TILELANG_CACHE_DIR" ] && tar czf "$OUT/tlcache.tgz" -C /tmp tlcache
  _pack_kernels > "$OUT/kernels.tar.xz"
  local size
  size=$(stat -c %s "$OUT/kernels.tar.xz")
  if [ "$size" -ge $((16 * 1024 * 1024)) ]; then
    echo "kernel cache: compiled kernels are $((size >> 20)) MiB packed, over the 16 MiB a returned file may have; not returned" >&2
    rm -f "$OUT/kernels.tar.xz"
  fi
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
  if [ -f "$from/kernels.tar.xz" ]; then
    mkdir -p "$union/kernels"
    [ -f .kernel-cache/kernels.tar.xz ] && tar xJf .kernel-cache/kernels.tar.xz -C "$union/kernels"
    tar xJf "$from/kernels.tar.xz" -C "$union/kernels"
    tar cf - -C "$union/kernels" . | xz -T0 -6 > .kernel-cache/kernels.tar.xz
  fi
  rm -rf "$union"
  du -sh .kernel-cache/* | sed 's/^/kernel cache: /'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  [ "${1:-}" = merge ] && [ -d "${2:-}" ] || { echo "usage: bash $0 merge <folder of a device call's files>" >&2; exit 2; }
  kernel_cache_merge "$2"
else
  kernel_cache_restore .kernel-cache
fi

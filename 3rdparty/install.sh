#!/usr/bin/env bash
# Creates or updates flame's Python environment and prints the interpreter to use.
#
#   bash 3rdparty/install.sh            # set up .venv (first use) and print its python
#
# - torch is installed first (FLAME_TORCH, default torch==2.13.0: the CPU build on machines
#   that have it locally, the CUDA build from PyPI elsewhere), then 3rdparty/requirements.txt
#   with torch held to what is installed, mamba_ssm's Triton kernels, on a machine with an NVIDIA GPU
#   3rdparty/requirements-gpu.txt (TileLang, which fla's Hopper path needs), torchao into <venv>/fp8
#   (3rdparty/requirements-fp8.txt says why apart), then flame itself (editable).
# - A source checkout placed at 3rdparty/torchtitan or 3rdparty/flash-linear-attention is
#   installed editable instead of the pinned wheel.
# - FLAME_PYTHON=/path/to/python skips all of this and uses that interpreter as it is
#   (for prepared environments, e.g. a cluster image).
# - FLAME_VENV moves the environment (default: <repo>/.venv).
# Re-runs are instant: a stamp records what was installed and only a change reinstalls.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -n "${FLAME_PYTHON:-}" ]; then
  echo "$FLAME_PYTHON"
  exit 0
fi

venv=${FLAME_VENV:-$root/.venv}
torch_spec=${FLAME_TORCH:-torch==2.13.0}
checkouts=()
for name in torchtitan flash-linear-attention; do
  [ -f "$root/3rdparty/$name/pyproject.toml" ] || [ -f "$root/3rdparty/$name/setup.py" ] && checkouts+=("$name")
done
gpu=no
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then gpu=yes; fi
want=$( (echo "$torch_spec ${checkouts[*]:-} gpu=$gpu"; cat "$root"/3rdparty/requirements*.txt \
  "$root/3rdparty/install.sh" "$root/pyproject.toml") | sha256sum | cut -c1-16)
stamp=$venv/.flame-stack
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi

{
  base_python=${PYTHON:-python3}
  "$base_python" -c 'import sys; assert sys.version_info >= (3, 10), "flame needs Python >= 3.10"'
  echo "flame: setting up $venv (first use; takes a minute or two)"
  [ -x "$venv/bin/python" ] || "$base_python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" "$torch_spec"
  installed_torch=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$installed_torch" > "$constraints"
  requirements=$(mktemp)
  trap 'rm -f "$constraints" "$requirements"' EXIT
  grep -v '^#' "$root/3rdparty/requirements.txt" > "$requirements"
  for name in "${checkouts[@]}"; do
    case $name in
      torchtitan) sed -i '/^torchtitan==/d' "$requirements" ;;
      flash-linear-attention) sed -i '/^fla-core==/d; /^flash-linear-attention==/d' "$requirements" ;;
    esac
  done
  "${pip[@]}" -r "$requirements" -c "$constraints"
  # mamba_ssm's Triton kernels (Mamba-2's SSD scan, Mamba-3's scans) without its CUDA extensions:
  # a pure-Python build of seconds, with no nvcc; flame.compat.mamba_ssm imports the kernel files
  # alone. Its declared dependencies (TileLang and others) are left out: the Triton kernels need none.
  "${pip[@]}" setuptools wheel packaging
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${pip[@]}" --no-build-isolation --no-deps mamba-ssm==2.3.2.post1
  if [ "$gpu" = yes ]; then
    echo "flame: an NVIDIA GPU is here: installing 3rdparty/requirements-gpu.txt (TileLang)"
    grep -v '^#' "$root/3rdparty/requirements-gpu.txt" > "$requirements"
    "${pip[@]}" -r "$requirements" -c "$constraints"
  fi
  # FP8's torchao beside the environment, on the path only of jobs that turn FP8 on (flame.models.float8)
  grep -v '^#' "$root/3rdparty/requirements-fp8.txt" > "$requirements"
  "${pip[@]}" --no-deps --upgrade --target "$venv/fp8" -r "$requirements"
  for name in "${checkouts[@]}"; do
    echo "flame: installing 3rdparty/$name (editable source checkout)"
    "${pip[@]}" --no-deps -e "$root/3rdparty/$name"
  done
  "${pip[@]}" --no-deps -e "$root"
  echo "$want" > "$stamp"
  echo "flame: environment ready"
} >&2
echo "$venv/bin/python"

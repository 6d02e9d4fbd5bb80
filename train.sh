#!/usr/bin/env bash
# flame's training command in a checkout: sets up the managed environment (.venv, first use only),
# then runs the launcher, flame/launch/train.sh, which documents every option and variable.
#
#   bash train.sh                        the embedded default job (configs/debug.toml)
#   bash train.sh --job.config_file configs/flame.toml --training.steps 100 ...
#   bash train.sh -h                     every option, with help
#
# `flame train ...` (the console command of an installed flame) runs the same launcher.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=$(bash "$root/3rdparty/install.sh") || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
FLAME_PYTHON=$python FLAME_COMMAND=${FLAME_COMMAND:-bash train.sh} exec bash "$root/flame/launch/train.sh" "$@"

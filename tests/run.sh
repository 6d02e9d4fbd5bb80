#!/usr/bin/env bash
# The one test command (README, CI): sets up the environment on first use, then runs pytest.
#   bash tests/run.sh                 the whole suite (tests/gpu is skipped without CUDA)
#   bash tests/run.sh -k resume -x    any pytest arguments
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$(bash "$root/3rdparty/install.sh")
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m pytest "$@"

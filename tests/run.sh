#!/usr/bin/env bash
# The one test command (README, CI): sets up the environment on first use, then runs pytest.
#   bash tests/run.sh                 the whole suite (tests/gpu is skipped without CUDA)
#   bash tests/run.sh -k resume -x    any pytest arguments
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$(bash "$root/3rdparty/install.sh")
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Two pytest workers, each taking whole files (their module fixtures are training runs, built once):
# most of a tiny CPU run is single-threaded start-up, so two side by side fill CI's 2 cores
# (docs/perf-log.md, 2026-11-27). -n 0 after it runs everything in this process (e.g. for --pdb).
# The 15 slowest tests are listed at the end: CI's budget is 30 minutes, and they are where it goes.
exec "$python" -m pytest -n 2 --dist loadfile --durations=15 "$@"

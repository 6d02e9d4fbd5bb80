"""Where the time from `bash train.sh` to step 1 goes, on a fresh machine and after it.

    python -m scripts.bench.startup --config configs/transformer_340M.json --work /tmp/startup -- <train.sh flags>

For each config, four launches of the same job (2 steps, every step logged):
  cold     empty Triton and inductor caches: a fresh machine (what flame ships is installed, as always)
  shipped  empty caches again, but with the autotune choices the cold run made: what shipping them saves
  warm     the caches the cold run filled: everything a machine caches
  bare     warm, started by bare torchrun instead of train.sh: the launcher's overhead
Each prints the seconds from launch to "Training starts" and to step 1, and what the ranks
spent compiling Triton kernels and benchmarking autotune configurations (a sitecustomize probe
in the ranks: Triton's compilation listener and its autotuner's disk-cache check). At the end
the cold run's choices are collected into flame/base/autotune_choices/ (python -m flame.base.autotune), and the
Triton kernels it compiled (recorded under FLAME_RECORD_KERNELS) into the list the launcher compiles ahead of step 1
on later machines (python -m flame.base.triton_kernels collect).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_1 = re.compile(r"\bstep +1/\d+")

PROBE = '''
import json, os, time
_out = os.environ.get("FLAME_STARTUP_PROBE")
if _out:
    _stats = {"compiled": 0, "compile_s": 0.0, "autotuned": 0, "autotune_s": 0.0}
    def _dump():  # at every event: a rank forked by train.sh's launcher ends without running atexit
        with open(f"{_out}.{os.getpid()}.json", "w") as f:
            json.dump(_stats, f)
    try:
        from triton import knobs
        from triton.runtime import autotuner
    except ImportError:
        knobs = None
    if knobs is not None:
        def _listener(*, src, metadata, metadata_group, times, cache_hit):
            if not cache_hit:
                _stats["compiled"] += 1
                _stats["compile_s"] += times.total / 1e6
                _dump()
        knobs.compilation.listener = _listener
        _check = autotuner.Autotuner.check_disk_cache
        def _timed_check(self, tuning_key, configs, bench_fn):
            start = time.time()
            hit = _check(self, tuning_key, configs, bench_fn)
            if not hit:
                _stats["autotuned"] += 1
                _stats["autotune_s"] += time.time() - start
                _dump()
            return hit
        autotuner.Autotuner.check_disk_cache = _timed_check
'''


def launch(name: str, argv: list[str], env: dict[str, str], work: Path, limit: float) -> dict:
    """Run ``argv``; the seconds to "Training starts" and to step 1, and the ranks' probe totals."""
    probe = work / f"{name}.probe"
    for old in work.glob(f"{name}.probe.*.json"):
        old.unlink()
    env = env | {"FLAME_STARTUP_PROBE": str(probe)}
    result = {"phase": name.rsplit("-", 1)[-1], "training_starts_s": None, "step1_s": None}
    start = time.monotonic()
    with open(work / f"{name}.log", "w", buffering=1) as log:  # line by line: a stopped driver keeps its logs
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   text=True, start_new_session=True)
        # a job that tunes kernels prints nothing for minutes: the limit cannot wait for a line
        timer = threading.Timer(limit, os.killpg, (process.pid, signal.SIGTERM))
        timer.start()
        for line in process.stdout:
            now = time.monotonic() - start
            log.write(f"[{now:7.1f}] {line}")
            plain = ANSI.sub("", line)
            if result["training_starts_s"] is None and "Training starts" in plain:
                result["training_starts_s"] = round(now, 1)
            if result["step1_s"] is None and STEP_1.search(plain):
                result["step1_s"] = round(now, 1)
        result["status"] = process.wait()
        timer.cancel()
    result["total_s"] = round(time.monotonic() - start, 1)
    for key in ("compiled", "compile_s", "autotuned", "autotune_s"):
        result[key] = 0
    for part in work.glob(f"{name}.probe.*.json"):
        for key, value in json.loads(part.read_text()).items():
            result[key] += value
    result["compile_s"] = round(result["compile_s"], 1)
    result["autotune_s"] = round(result["autotune_s"], 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/flame-startup"))
    parser.add_argument("--limit", type=float, default=400, help="seconds per launch")
    parser.add_argument("--phases", default="cold,shipped,warm,bare")
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    args.work.mkdir(parents=True, exist_ok=True)
    site = args.work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(PROBE)
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    base.setdefault("FLAME_PYTHON", sys.executable)
    base.update(PYTHONUNBUFFERED="1", TRITON_CACHE_AUTOTUNING="1", NGPU="1")
    results = []
    for config in args.config:
        stem = Path(config).stem
        caches = {phase: (args.work / stem / f"triton-{phase}", args.work / stem / f"inductor-{phase}")
                  for phase in ("cold", "shipped")}
        (args.work / stem / "kernels-cold.jsonl").unlink(missing_ok=True)  # a record appends
        for triton, inductor in caches.values():
            shutil.rmtree(triton, ignore_errors=True)
            shutil.rmtree(inductor, ignore_errors=True)
        job = [*flags, "--model.config", config, "--training.steps", "2", "--metrics.log_freq", "1",
               "--checkpoint.no-enable"]
        for phase in args.phases.split(","):
            triton, inductor = caches["shipped" if phase == "shipped" else "cold"]
            if phase == "shipped":  # only the cold run's choices, none of its compiled kernels
                for choice in caches["cold"][0].glob("*/*.autotune.json"):
                    (triton / choice.parent.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(choice, triton / choice.parent.name / choice.name)
            env = base | {"TRITON_CACHE_DIR": str(triton), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
            if phase == "cold":
                env["FLAME_RECORD_KERNELS"] = str(args.work / stem / "kernels-cold.jsonl")
            dump = ["--job.dump_folder", str(args.work / stem / f"dump-{phase}")]
            shutil.rmtree(args.work / stem / f"dump-{phase}", ignore_errors=True)
            if phase == "bare":
                argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        "-m", "flame.train", *job, *dump]
            else:
                argv = ["bash", "train.sh", *job, *dump]
            result = launch(f"{stem}-{phase}", argv, env, args.work, args.limit) | {"config": stem}
            results.append(result)
            print(json.dumps(result), flush=True)
        if "cold" in args.phases:
            subprocess.run([sys.executable, "-m", "flame.base.autotune", "collect", "--cache", str(caches["cold"][0])],
                           cwd=ROOT, env=base, check=False)
            if (recorded := args.work / stem / "kernels-cold.jsonl").exists():
                subprocess.run([sys.executable, "-m", "flame.base.triton_kernels", "collect", str(recorded)], cwd=ROOT,
                               env=base, check=False)
    (args.work / "startup.json").write_text(json.dumps(results, indent=1))
    print(f"{'config':<20} {'phase':<8} {'starts':>7} {'step 1':>7} {'compiled':>9} {'compile s':>9} "
          f"{'autotuned':>9} {'tune s':>7}")
    for r in results:
        print(f"{r['config']:<20} {r['phase']:<8} {r['training_starts_s'] or '-':>7} {r['step1_s'] or '-':>7} "
              f"{r['compiled']:>9} {r['compile_s']:>9} {r['autotuned']:>9} {r['autotune_s']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

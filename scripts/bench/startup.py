"""Where the time from `bash train.sh` to step 1 goes, on a fresh machine and after it.

    python -m scripts.bench.startup --config configs/transformer_340M.json --work /tmp/startup -- <train.sh flags>

For each config, launches of the same job (--steps steps, every step logged), by phase:
  cold     empty Triton and inductor caches, no background compile of the shipped kernel list
           (FLAME_WARM_KERNELS=0): a fresh machine without flame's warm-up (what flame ships is
           installed, as always); the kernels the job's check and the ranks compile are recorded
           (FLAME_RECORD_KERNELS)
  ahead    empty caches again, the launcher's warm-up on, compiling the shipped list, which now
           holds the cold run's kernels: a fresh machine once this config's list ships
  shipped  empty caches holding only the autotune choices the cold run made: what shipping them saves
  warm     the caches the cold run filled: everything a machine caches
  bare     warm, started by bare torchrun instead of train.sh: the launcher's overhead
Every phase but warm and bare also starts with its own empty flame cache (FLAME_CACHE: the memory
plan's activation probes, FP8 timings), holding only the built-in corpus and the machine's measured
rates from the usual cache (build them first: one run, or python -m flame.memory.hardware).
Each prints the seconds from launch to "Training starts" and to step 1, tok/s at the last step,
how many shipped kernels the launcher's warm-up put in the cache and when, and what every process
of the run (the job's check, the ranks, the warm-up's pool) spent compiling Triton kernels and
benchmarking autotune configurations (a sitecustomize probe: Triton's compilation listener and
its autotuner's disk-cache check). Right after a cold run its choices are collected into
flame/base/autotune_choices/ (python -m flame.base.autotune) and the Triton kernels it compiled
into the list the launcher compiles ahead (python -m flame.base.triton_kernels collect).
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
WARMED = re.compile(r"flame: (\d+) of the (\d+) Triton kernels shipped")
TOKENS_PER_S = re.compile(r"\bstep +\d+/\d+ .*tok/s/device ([\d,]+)")

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
    result = {"phase": name.rsplit("-", 1)[-1], "training_starts_s": None, "step1_s": None, "last_tok_s": None,
              "warmed": None}
    start = time.monotonic()
    with open(work / f"{name}.log", "w", buffering=1) as log:  # line by line: a stopped driver keeps its logs
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   text=True, start_new_session=True)
        # a job that tunes kernels prints nothing for minutes: the limit cannot wait for a line. flame's first signal
        # finishes the current step, which on a cold machine is the one still compiling for minutes: a second one
        # stops at once, and a rank that still lingers is killed
        timers = [threading.Timer(limit + delay, _signal_group, (process.pid, sig))
                  for delay, sig in ((0, signal.SIGTERM), (10, signal.SIGTERM), (40, signal.SIGKILL))]
        for timer in timers:
            timer.start()
        for line in process.stdout:
            now = time.monotonic() - start
            log.write(f"[{now:7.1f}] {line}")
            plain = ANSI.sub("", line)
            if result["training_starts_s"] is None and "Training starts" in plain:
                result["training_starts_s"] = round(now, 1)
            if result["step1_s"] is None and STEP_1.search(plain):
                result["step1_s"] = round(now, 1)
            if warmed := WARMED.search(plain):  # the launcher's warm-up: kernels in the cache, and when
                result["warmed"] = f"{warmed.group(1)}/{warmed.group(2)} at {now:.0f} s"
            if rate := TOKENS_PER_S.search(plain):
                result["last_tok_s"] = int(rate.group(1).replace(",", ""))
        result["status"] = process.wait()
        for timer in timers:
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


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # ended meanwhile
        pass


def collect(cache: Path, recorded: Path, env: dict[str, str]) -> None:
    """Ship what a cold run chose and compiled: its autotune choices and its kernel list (the ``ahead`` phase reads
    both, as a fresh machine would)."""
    subprocess.run([sys.executable, "-m", "flame.base.autotune", "collect", "--cache", str(cache)], cwd=ROOT, env=env,
                   check=False)
    if recorded.exists():
        subprocess.run([sys.executable, "-m", "flame.base.triton_kernels", "collect", str(recorded)], cwd=ROOT, env=env,
                       check=False)


def fresh_flame_cache(folder: Path, usual: Path) -> Path:
    """An empty flame cache but for the usual one's built-in corpus and measured rates: a fresh machine whose one-time
    set-up (building the corpus, measuring the machine) is done, so that no phase pays it for the others."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for kept in ("builtin", "hardware"):
        if (usual / kept).is_dir():
            (folder / kept).symlink_to(usual / kept)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/flame-startup"))
    parser.add_argument("--limit", type=float, default=400, help="seconds per launch")
    parser.add_argument("--phases", default="cold,ahead,shipped,warm,bare")
    parser.add_argument("--steps", type=int, default=2, help="steps per launch (tok/s is the last one's)")
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
    usual_cache = Path(os.environ.get("FLAME_CACHE", Path.home() / ".cache" / "flame"))
    results = []
    for config in args.config:
        stem = Path(config).stem
        caches = {phase: (args.work / stem / f"triton-{phase}", args.work / stem / f"inductor-{phase}")
                  for phase in ("cold", "ahead", "shipped")}
        (args.work / stem / "kernels-cold.jsonl").unlink(missing_ok=True)  # a record appends
        for triton, inductor in caches.values():
            shutil.rmtree(triton, ignore_errors=True)
            shutil.rmtree(inductor, ignore_errors=True)
        job = [*flags, "--model.config", config, "--training.steps", str(args.steps), "--metrics.log_freq", "1",
               "--checkpoint.no-enable"]
        for phase in args.phases.split(","):
            triton, inductor = caches[phase if phase in caches else "cold"]
            if phase == "shipped":  # only the cold run's choices, none of its compiled kernels
                for choice in caches["cold"][0].glob("*/*.autotune.json"):
                    (triton / choice.parent.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(choice, triton / choice.parent.name / choice.name)
            flame_cache = (fresh_flame_cache(args.work / stem / f"flame-{phase}", usual_cache) if phase in caches
                           else args.work / stem / "flame-cold")
            env = base | {"TRITON_CACHE_DIR": str(triton), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
                          "FLAME_CACHE": str(flame_cache)}
            if phase in ("cold", "shipped"):  # neither compiles the shipped kernel list ahead
                env["FLAME_WARM_KERNELS"] = "0"
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
            if phase == "cold":
                collect(caches["cold"][0], args.work / stem / "kernels-cold.jsonl", base)
    (args.work / "startup.json").write_text(json.dumps(results, indent=1))
    print(f"{'config':<20} {'phase':<8} {'starts':>7} {'step 1':>7} {'compiled':>9} {'compile s':>9} "
          f"{'autotuned':>9} {'tune s':>7} {'tok/s':>8}  warm-up")
    for r in results:
        print(f"{r['config']:<20} {r['phase']:<8} {r['training_starts_s'] or '-':>7} {r['step1_s'] or '-':>7} "
              f"{r['compiled']:>9} {r['compile_s']:>9} {r['autotuned']:>9} {r['autotune_s']:>7} {r['last_tok_s'] or '-':>8}  {r['warmed'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

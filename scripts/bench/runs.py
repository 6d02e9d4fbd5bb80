"""Running a GPU check's steps: processes under time limits, their logs, seed checkpoints, kernel caches.

Logs and metrics go to the work folder (<work>/<suite>/); after every step the suite's folder
is packed into <out>/<suite>.tgz, so a device command that is stopped still returns what
finished, in few files. A train.sh run keeps only its log and metrics.jsonl; after a failure,
every rank's stderr is kept beside them as <name>.rank<N>.err.

fla's kernels tune and compile on a fresh GPU machine for minutes before step 1. Each machine
caches the results, and two of them can travel from one device command to the next in
.kernel-cache/ (gitignored; carried to the device):
  autotune.tgz   Triton's autotune choices (*.autotune.json, kept with TRITON_CACHE_AUTOTUNING=1)
  tlcache.tgz    TileLang's compiled kernels (the gated delta-rule family's backward on Hopper)
Triton's and inductor's compiled kernels are not carried: they are larger than a returned
file may be. The driver unpacks the carried caches once per machine and writes the machine's
into <out> after every step; `gpu_check.py --merge-cache <folder>` merges what came back.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts.bench import trace_summary
from scripts.bench.plan import Step, stem

ROOT = Path(__file__).resolve().parents[2]
# Outside the work folder: a 340M seed with its optimizer state is 4 GB, and every suite reuses it
SEEDS = Path("/tmp/flame-seeds")
CARRIED_CACHES = ROOT / ".kernel-cache"
TRITON_CACHE = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
TILELANG_CACHE = Path("/tmp/tlcache")  # tlcache.tgz holds tlcache/, unpacked in /tmp
RESTORED_MARKER = Path("/tmp/.flame-kernel-cache-restored")
STACKS_BEFORE_LIMIT = 15  # seconds: a run's ranks print their Python stacks this long before its limit

PROFILE_TRACES = "profile_traces"  # torchtitan's --profiling.save_traces_folder, which the suites leave as it is


@dataclass
class Result:
    step: Step
    status: int | None  # exit status; None: not run
    seconds: float = 0.0
    note: str = ""  # why it did not run, or where to look


def environment(cpu: bool) -> dict[str, str]:
    """The environment of every step (and of the driver itself)."""
    env = dict(os.environ)
    env.setdefault("FLAME_PYTHON", sys.executable)  # train.sh runs this interpreter, not a managed .venv
    env.setdefault("FLAME_CACHE", "/tmp/flame-cache")
    env.update(NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
               TRITON_CACHE_AUTOTUNING="1", TILELANG_CACHE_DIR=str(TILELANG_CACHE))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def execute(argv: list[str], log: Path, limit: float, env: dict[str, str]) -> int:
    """Run ``argv`` from the repository root with its output in ``log``; 124 when stopped at ``limit`` seconds."""
    with open(log, "w") as output:
        # its own process group: at the limit, torchrun, every rank and their loader workers stop together
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                   start_new_session=True)
        try:
            return process.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            output.write(f"\ngpu_check: stopped at the limit of {limit:.0f} s\n")
            return 124


def seed_folder(config: str) -> Path:
    """Where the config's seed checkpoint is kept (named after its path: two configs may share a file name)."""
    return SEEDS / str(Path(config).with_suffix("")).strip("/").replace("/", "_")


def seed_flags(step: Step, work: Path, limit: float, env: dict[str, str]) -> list[str] | None:
    """Flags that start a run from the config's seed checkpoint, made once by one process; None if that failed.

    Without it GPU layouts start from different draws (DTensor's RNG gives sharded weights other
    values than one GPU's init), and their curves could agree only statistically, even in fp32.
    """
    seed = seed_folder(step.config)
    if not (seed / "checkpoint" / "step-0").is_dir():
        SEEDS.mkdir(parents=True, exist_ok=True)
        argv = ["bash", "train.sh", *step.common, "--model.config", step.config, "--job.dump_folder", str(seed),
                "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
        if execute(argv, work / f"{stem(step.config)}-seed.log", limit, env | {"NGPU": "1"}) != 0:
            return None
    return ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.initial_load_path",
            str(seed / "checkpoint" / "step-0")]


def run_step(step: Step, work: Path, limit: Callable[[], float], env: dict[str, str]) -> Result:
    """Run one step into ``work`` (the suite's folder); ``limit()`` is the time it may take from now
    (asked again after making a seed checkpoint, which has a limit of its own)."""
    start = time.monotonic()
    log = work / f"{step.name}.log"
    if not step.train:
        return Result(step, execute(step.argv, log, limit(), env), time.monotonic() - start)
    seed = []
    if step.seeded:
        seed = seed_flags(step, work, limit(), env)
        if seed is None:
            return Result(step, 1, time.monotonic() - start, f"its seed checkpoint failed: {stem(step.config)}-seed.log")
    seconds = limit()
    dump = work / step.name
    shutil.rmtree(dump, ignore_errors=True)
    argv = ["bash", "train.sh", *step.common, "--model.config", step.config, "--job.dump_folder", str(dump),
            *seed, *step.argv]
    # every rank prints its stacks shortly before the limit, so a run that hangs shows where each rank waits
    stacks = {"FLAME_DUMP_STACKS_AFTER": str(max(1, int(seconds) - STACKS_BEFORE_LIMIT))}
    status = execute(argv, log, seconds, env | {"NGPU": str(step.gpus)} | stacks)
    note = ""
    if status:
        for err in dump.glob("logs/*/attempt_*/*/stderr.log"):
            if err.stat().st_size:
                shutil.copy(err, work / f"{step.name}.rank{err.parent.name}.err")
                note = f"ranks' stderr: {step.name}.rank*.err"
    traces = sorted(dump.glob(f"{PROFILE_TRACES}/iteration_*/rank0_trace.json"), key=lambda t: int(t.parent.name[10:]))
    if traces:  # --profiling.enable_profiling: the last profiled step, summed by kind (the trace is hundreds of MB)
        (work / f"{step.name}.profile.txt").write_text(trace_summary.summarize(traces[-1]) + "\n")
    for entry in dump.iterdir() if dump.is_dir() else ():
        if entry.name != "metrics.jsonl":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return Result(step, status, time.monotonic() - start, note)


def pack(folder: Path, archive: Path) -> None:
    """``folder`` as ``archive`` (.tgz), replaced whole so that a reader never sees half of it."""
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            # runs side by side (--spread) clear their dump folders as this packs: what is gone is skipped
            with contextlib.suppress(FileNotFoundError):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    partial.replace(archive)


def restore_kernel_caches() -> None:
    """Unpack the carried caches, once per machine: again would replace files that running jobs may read."""
    if RESTORED_MARKER.exists():
        return
    RESTORED_MARKER.touch()
    for archive, target in (("autotune.tgz", TRITON_CACHE), ("tlcache.tgz", TILELANG_CACHE.parent)):
        if (CARRIED_CACHES / archive).is_file():
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(CARRIED_CACHES / archive) as tar:
                tar.extractall(target, filter="data")


def save_kernel_caches(out: Path) -> None:
    """This machine's autotune choices and TileLang kernels -> <out>/autotune.tgz, <out>/tlcache.tgz."""
    choices = sorted(TRITON_CACHE.rglob("*.autotune.json")) if TRITON_CACHE.is_dir() else []
    if choices:
        partial = out / "autotune.partial"
        with tarfile.open(partial, "w:gz") as tar:
            for path in choices:
                tar.add(path, arcname=str(path.relative_to(TRITON_CACHE)))
        partial.replace(out / "autotune.tgz")
    if TILELANG_CACHE.is_dir():
        partial = out / "tlcache.partial"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(TILELANG_CACHE, arcname=TILELANG_CACHE.name)
        partial.replace(out / "tlcache.tgz")


def merge_kernel_caches(folder: Path) -> list[str]:
    """Merge a device command's returned caches into .kernel-cache/ (the union with what is there)."""
    merged = []
    CARRIED_CACHES.mkdir(exist_ok=True)
    for name in ("autotune.tgz", "tlcache.tgz"):
        if not (folder / name).is_file():
            continue
        with tempfile.TemporaryDirectory() as union:
            for archive in (CARRIED_CACHES / name, folder / name):
                if archive.is_file():
                    with tarfile.open(archive) as tar:
                        tar.extractall(union, filter="data")
            pack(Path(union), CARRIED_CACHES / name)
        merged.append(f"{CARRIED_CACHES / name}: {(CARRIED_CACHES / name).stat().st_size / 2**10:,.0f} KiB")
    return merged

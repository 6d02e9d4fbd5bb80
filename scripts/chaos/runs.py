"""train.sh as a user runs it, in a process group of its own that the harness can kill whole.

Also what every case checks afterwards: the processes a run left alive, its logged losses,
its Hugging Face export. Nothing here imports flame: the harness sees a run only through its
command line and its dump folder, as a user does.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOSS = "loss_metrics/global_avg_loss"
POLL = 0.002  # seconds between looks at the disk: a save of the debug model lasts a fraction of a second


@dataclass
class Job:
    """One training job: the debug job on a short schedule (``steps``, a checkpoint every ``interval``,
    every step logged) plus ``extra`` flags, in ``procs`` processes, dumped to ``dump``."""

    dump: Path
    procs: int
    steps: int
    interval: int
    extra: list[str] = field(default_factory=list)

    @property
    def checkpoints(self) -> Path:
        return self.dump / "checkpoint"

    @property
    def save_steps(self) -> list[int]:
        """The steps a complete run saves (torchtitan also saves the last one)."""
        return sorted(set(range(self.interval, self.steps + 1, self.interval)) | {self.steps})

    def command(self) -> list[str]:
        return ["bash", str(ROOT / "train.sh"), "--job.config_file", str(ROOT / "configs" / "debug.toml"),
                "--training.steps", str(self.steps), "--checkpoint.interval", str(self.interval),
                "--metrics.log_freq", "1", *self.extra, "--job.dump_folder", str(self.dump)]

    def env(self) -> dict[str, str]:
        # One thread per rank unless set: every attempt runs as its reference did (a reduction's result
        # may depend on the thread count), and runs side by side share the cores
        return os.environ | {"FLAME_PYTHON": sys.executable, "NGPU": str(self.procs), "PYTHONUNBUFFERED": "1",
                             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


class Attempt:
    """One ``bash train.sh`` of a job, started in a new session: its process group is its pid."""

    def __init__(self, job: Job, log: Path):
        self.job = job
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self.started_ns = time.time_ns()
        self.started = time.monotonic()
        with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
            self.process = subprocess.Popen(job.command(), cwd=ROOT, env=job.env(), stdout=out, stderr=err,
                                            start_new_session=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> list["Process"]:
        """``kill -9`` of train.sh's whole process group; its process tree just before."""
        tree = descendants(self.process.pid)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        return tree

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None after ``timeout`` seconds (the run and what it left are then killed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_all(leftovers(self.job.dump, self.kill()))
            return None

    @property
    def stdout(self) -> str:
        return self.log.with_suffix(".out").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.log.with_suffix(".err").read_text(errors="replace")


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class Process:
    pid: int
    start: str  # its start time (field 22 of /proc/<pid>/stat): a pid reused later is another process
    command: str


def _read(pid: int) -> tuple[int, Process] | None:
    """(parent pid, process) of a live ``pid``, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) "; the name may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: it runs nothing
        return None
    return int(fields[1]), Process(pid, fields[19], command.replace(b"\0", b" ").decode(errors="replace").strip())


def parent_of(pid: int) -> int | None:
    """The parent pid of a live ``pid``, or None."""
    found = _read(pid)
    return found[0] if found else None


def _process(pid: int) -> Process | None:
    found = _read(pid)
    return found[1] if found else None


def _all_processes() -> dict[int, tuple[int, Process]]:
    """pid -> (parent pid, process) of every live process."""
    return {int(e.name): found for e in os.scandir("/proc") if e.name.isdigit() and (found := _read(int(e.name)))}


def descendants(pid: int) -> list[Process]:
    """The live processes under ``pid`` (children, their children, ...)."""
    table = _all_processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(table[child][1])
        todo.extend(children.get(child, []))
    return found


def leftovers(dump: Path, tree: list[Process]) -> list[Process]:
    """The processes still alive of a killed run: those of ``tree`` (its process tree when killed)
    and any whose command line names ``dump`` (ranks, data-loader workers, the HF export)."""
    needle = f" {dump} "
    alive = {p.pid: p for p in tree if _process(p.pid) == p}
    for _, process in _all_processes().values():
        if needle in f" {process.command} " and process.pid != os.getpid():
            alive[process.pid] = process
    return sorted(alive.values(), key=lambda p: p.pid)


def orphans_after(dump: Path, tree: list[Process], grace: float) -> tuple[list[Process], list[str]]:
    """What a killed run did after the kill: its processes still alive ``grace`` seconds later (returns
    at once when none is), and what they wrote meanwhile (a rank that finishes the job within the grace
    period is gone by then, but its records and checkpoints show it outlived the kill)."""
    before = footprint(dump)
    deadline = time.monotonic() + grace
    while (alive := leftovers(dump, tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = footprint(dump)
    wrote = [f"{name} {before[name]} -> {after[name]}" for name in before if before[name] != after[name]]
    return alive, wrote


def kill_all(processes: list[Process]) -> None:
    """SIGKILL these processes (each only if its pid is still the same process) and wait until they are gone."""
    for process in processes:
        if _process(process.pid) == process:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while any(_process(p.pid) == p for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------- what a run left on disk


def metric_lines(dump: Path) -> list[str]:
    path = dump / "metrics.jsonl"
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def losses(lines: list[str]) -> tuple[dict[int, float], int]:
    """step -> logged loss of the step's latest record (the latest attempt's: attempts run one after
    another), and how many lines are not a JSON record (a line cut by a kill, or two runs interleaved)."""
    found, unreadable = {}, 0
    for line in lines:
        try:
            row = json.loads(line)
            found[int(row["step"])] = float(row[LOSS])
        except (ValueError, KeyError, TypeError):
            unreadable += 1
    return found, unreadable


def loss_differences(got: dict[int, float], expected: dict[int, float]) -> list[str]:
    """Where ``got`` is not bit-identical to ``expected``: missing steps, other values (exact float equality)."""
    problems = [f"step {s} not logged" for s in sorted(set(expected) - set(got))]
    problems += [f"step {s}: loss {got[s]!r}, reference {expected[s]!r}" for s in sorted(expected)
                 if s in got and got[s] != expected[s]]
    problems += [f"step {s} logged, the reference has no such step" for s in sorted(set(got) - set(expected))]
    return problems


def complete_steps(folder: Path) -> list[int]:
    """The steps of checkpoint ``folder`` whose DCP save finished (.metadata is written last)."""
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.glob("step-*")
                  if p.name[5:].isdigit() and (p / ".metadata").is_file())


def footprint(dump: Path) -> dict[str, object]:
    """What a run has written so far, in a few numbers that change as it goes on."""
    hf = dump / "hf" / "config.json"
    return {"metrics.jsonl lines": len(metric_lines(dump)), "complete steps": complete_steps(dump / "checkpoint"),
            "HF export": hf.stat().st_mtime_ns if hf.is_file() else None}


def staging_folders(dump: Path) -> list[str]:
    """Export staging folders (.hf-*) in the dump folder: what an interrupted HF export leaves."""
    return sorted(p.name for p in dump.glob(".hf-*")) if dump.is_dir() else []


def exported_weights(dump: Path) -> dict:
    """The state dict of <dump>/hf, loaded with plain transformers on CPU (raises if it does not load)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(dump / "hf", dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def export_problems(dump: Path, reference: dict) -> list[str]:
    """What is wrong with a finished run's HF export: absent, not loadable, weights other than ``reference``'s."""
    import torch

    if not (dump / "hf" / "config.json").is_file():
        return ["no HF export"]
    try:
        weights = exported_weights(dump)
    except Exception as error:  # the harness reports any failure to load; it does not stop on one
        return [f"HF export does not load: {type(error).__name__}: {str(error).splitlines()[0][:200]}"]
    if weights.keys() != reference.keys() or not all(torch.equal(weights[k], reference[k]) for k in reference):
        return ["HF export's weights differ from the reference's"]
    return []


@dataclass
class Reference:
    """An uninterrupted run of a job: its losses, its exported weights, when each step was logged."""

    job: Job
    losses: dict[int, float]
    weights: dict
    duration: float  # seconds, train.sh start to exit
    logged_at: dict[int, float] = field(default_factory=dict)  # step -> seconds after start

    def expected_duration(self, resumed_from: int) -> float:
        """About how long an attempt that resumes after step ``resumed_from`` runs (0: a fresh start)."""
        skipped = self.logged_at.get(resumed_from, 0.0) - self.logged_at.get(1, 0.0) if resumed_from else 0.0
        return max(self.duration - skipped, 1.0)


class RunFailed(RuntimeError):
    pass


def run_reference(job: Job, log: Path, timeout: float = 1800) -> Reference:
    """Run ``job`` to the end, uninterrupted, noting when each step's metrics line appears."""
    attempt = Attempt(job, log)
    logged_at, count = {}, 0
    while attempt.running() and attempt.elapsed < timeout:
        lines = metric_lines(job.dump)
        if len(lines) > count:
            for step in losses(lines[count:])[0]:
                logged_at.setdefault(step, attempt.elapsed)
            count = len(lines)
        time.sleep(0.05)
    status = attempt.wait(1)
    if status != 0:
        raise RunFailed(f"the reference run {job.dump} failed (exit {status}):\n{attempt.stderr[-3000:]}")
    found, unreadable = losses(metric_lines(job.dump))
    if unreadable:
        raise RunFailed(f"the reference run's {job.dump / 'metrics.jsonl'} has {unreadable} unreadable lines")
    return Reference(job, found, exported_weights(job.dump), attempt.elapsed, logged_at)

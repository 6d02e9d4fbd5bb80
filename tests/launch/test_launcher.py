"""train.sh's hold on a run: its processes end with it, one run per dump folder, attempts recorded."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flame.base.dump_folder import LOCK_FILE, STALE_S, DumpFolderLock, gone
from tests.conftest import (
    ROOT,
    base_args,
    check,
    flame_env,
    metrics,
    torchrun,
    train_job,
)


def train_sh(*args: str, **popen) -> subprocess.Popen:
    """train.sh started on one process, its stdout and stderr piped."""
    env = flame_env() | {"FLAME_PYTHON": sys.executable, "NGPU": "1"}
    for name in ("NNODE", "NODE_RANK", "SLURM_JOB_ID", "FLAME_DRY_RUN"):
        env.pop(name, None)
    return subprocess.Popen(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(process: subprocess.Popen, timeout: int = 600) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_processes(dump: Path) -> list[int]:
    """Pids of the processes running flame.train on ``dump``: its ranks and their data-loader workers."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:  # ended meanwhile
            continue
        if b"flame.train" in command and any(str(dump).encode() in part for part in command):
            pids.append(int(entry.name))
    return pids


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"train.sh ended (exit {process.returncode}) before {what}:\n{finish(process).stderr}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def process_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # ended meanwhile
        return None


def trains(dump: Path) -> bool:
    """Whether the run on ``dump`` has logged a training step."""
    path = dump / "metrics.jsonl"
    return path.is_file() and bool(path.read_text().strip())


@pytest.mark.background_runs(first=train_job(4, "--checkpoint.interval=2"))  # bare torchrun: rank 0 numbers it
def test_a_run_that_fails_to_start_keeps_the_job_config_and_metrics_name_their_attempt(background_runs, tiny_model,
                                                                                       corpus):
    dump, result = background_runs["first"]
    check(result)
    saved = (dump / "job_config.json").read_text()
    assert saved == (dump / "attempts" / "1" / "job_config.json").read_text()

    # no step 3 to load: fails after building the model (a bare torchrun launch has no preflight)
    failed = torchrun(base_args(tiny_model, corpus, dump, steps=6) + [
        "--checkpoint.load_step=3", "--checkpoint.export_dtype=bfloat16"])
    assert failed.returncode != 0
    assert (dump / "job_config.json").read_text() == saved
    assert sorted(p.name for p in (dump / "attempts").iterdir()) == ["1"]

    # a run killed after logging step 4, before saving it: its resume from step 2 logs steps 3 and 4 again
    shutil.rmtree(dump / "checkpoint" / "step-4")
    check(finish(train_sh(*base_args(tiny_model, corpus, dump, steps=6), "--checkpoint.interval=2")))
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [(row["attempt"], row["step"]) for row in rows] == [(1, 1), (1, 2), (1, 3), (1, 4),
                                                             (2, 3), (2, 4), (2, 5), (2, 6)]
    assert {step: row["attempt"] for step, row in metrics(dump).items()} == {1: 1, 2: 1, 3: 2, 4: 2, 5: 2, 6: 2}
    latest = json.loads((dump / "job_config.json").read_text())
    assert latest == json.loads((dump / "attempts" / "2" / "job_config.json").read_text())
    assert latest["training"]["steps"] == 6 and latest["checkpoint"]["export_dtype"] == "float32"
    assert json.loads((dump / "attempts" / "1" / "job_config.json").read_text())["training"]["steps"] == 4


def kill_train_sh_while_it_trains(dump: Path, model: str, data: str) -> subprocess.CompletedProcess:
    """A background job: ``kill -9`` of train.sh once its rank trains; records in
    <dump>/../pids.json the run's processes just before the kill and 15 s after (then ends those)."""
    launcher = train_sh(*base_args(model, data, dump, steps=100_000), "--checkpoint.no-enable",
                        start_new_session=True)
    try:
        wait_for(lambda: trains(dump), "a training step", launcher)
        before = run_processes(dump)
        names = [name for name in map(process_name, before) if name]
        os.kill(launcher.pid, signal.SIGKILL)  # train.sh alone: its launcher and the ranks must follow
        result = finish(launcher)
        deadline = time.monotonic() + 15  # a rank ends at once; its data-loader workers notice within 5 s
        while run_processes(dump) and time.monotonic() < deadline:
            time.sleep(0.2)
        (dump.parent / "pids.json").write_text(json.dumps({"before": before, "names": names,
                                                           "after": run_processes(dump)}))
        return result
    finally:
        for pid in run_processes(dump):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.background_runs(killed=kill_train_sh_while_it_trains)
def test_kill_9_of_train_sh_ends_every_rank(background_runs):
    dump, result = background_runs["killed"]
    assert result.returncode == -signal.SIGKILL
    pids = json.loads((dump.parent / "pids.json").read_text())
    assert pids["before"], "the rank ran"
    assert pids["after"] == [], "a rank outlived its launcher"
    # docs/running.md, "If a run seems stuck": pkill -USR2 '^flame-rank' finds the rank, not the launcher whose
    # command line it shares, nor the data-loader workers
    assert pids["names"].count("flame-rank0") == 1 and len(pids["names"]) > 1, pids["names"]


def second_run_while_the_first_trains(dump: Path, model: str, data: str) -> subprocess.CompletedProcess:
    """A background job: train.sh on 8 steps; once it trains, with its processes held still, train.sh
    on the same dump folder. Returns the first's result; the second's and what the first's files
    were before and after it, in <dump>/../second.json."""
    first = train_sh(*base_args(model, data, dump, steps=8), "--checkpoint.no-enable")
    ranks = []

    def files() -> dict[str, int]:  # but the lock, whose holder's heartbeat touches it
        return {str(p): p.stat().st_mtime_ns for p in dump.rglob("*") if p.is_file() and p.name != LOCK_FILE}

    try:
        wait_for(lambda: trains(dump), "a training step", first)
        ranks = run_processes(dump)
        for pid in ranks:  # the first run holds still, however slow the second is to start
            os.kill(pid, signal.SIGSTOP)
        before = files()
        second = finish(train_sh(*base_args(model, data, dump, steps=3), "--optimizer.lr=1e-3"))
        holder = (dump / LOCK_FILE).read_text() if (dump / LOCK_FILE).is_file() else "null"
        (dump.parent / "second.json").write_text(json.dumps({
            "returncode": second.returncode, "stderr": second.stderr, "holder": holder,
            "files_before": before, "files_after": files()}))
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        result = finish(first)
    return result


@pytest.mark.background_runs(first=second_run_while_the_first_trains)
def test_a_second_run_on_the_dump_folder_is_refused_in_one_line_and_the_first_goes_on(background_runs):
    dump, first = background_runs["first"]
    second = json.loads((dump.parent / "second.json").read_text())
    assert second["returncode"] == 2, second["stderr"][-3000:]
    holder = json.loads(second["holder"])
    assert holder["host"] == socket.gethostname() and holder["attempt"] == 1
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    assert second["stderr"].strip().splitlines() == [
        f"flame: error: --job.dump_folder {dump} is in use by another run (host {holder['host']}, pid "
        f"{holder['pid']}, since {since}): wait for it to end or stop it (kill {holder['pid']} on {holder['host']}), "
        "or choose another --job.dump_folder"]
    assert second["files_after"] == second["files_before"]

    check(first)
    assert sorted(metrics(dump)) == list(range(1, 9))
    assert {json.loads(line)["attempt"] for line in (dump / "metrics.jsonl").read_text().splitlines()} == {1}
    assert json.loads((dump / "job_config.json").read_text())["training"]["steps"] == 8
    assert (dump / LOCK_FILE).read_text() == "", "the lock is free once the run ended"


def test_the_launcher_refuses_a_dump_folder_locked_after_the_check(tmp_path, monkeypatch, capsys):
    from flame.launch import supervise
    from flame.launch.preflight import LaunchPlan

    # between the check's look and the launcher's lock another run may have taken the folder
    class Checked:  # the check passed, as it did before another run took the folder
        def __init__(self, *args):
            pass

        def outcome(self):
            return LaunchPlan(str(tmp_path), True, str(tmp_path / "checkpoint"))

    monkeypatch.setattr(supervise, "warm_up", lambda: "fork")
    monkeypatch.setattr(supervise, "JobCheck", Checked)
    monkeypatch.setattr(supervise, "die_with_parent", lambda *args: None)  # this is pytest's process
    lock = DumpFolderLock(str(tmp_path), "torchrun -m flame.train (the test)")
    lock.acquire()
    try:
        status = supervise.main(["--world-size", "1", "--", "--standalone", "--nproc_per_node", "1",
                                 "-m", "flame.train", f"--job.dump_folder={tmp_path}"])
    finally:
        lock.release()
    assert status == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"flame: error: --job.dump_folder {tmp_path} is in use by another run "
                           f"(host {socket.gethostname()}, pid {os.getpid()}, since "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


def test_a_holder_on_another_host_counts_as_gone_without_a_heartbeat_or_when_its_job_was_requeued(monkeypatch):
    holder = {"host": "node-that-is-not-this-one", "pid": 1, "started": 0, "slurm_job_id": "4242"}
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert gone(holder, flock_free=True, heartbeat_age=STALE_S / 4) is None  # flock is not shared by every filesystem
    assert gone(holder, flock_free=False, heartbeat_age=STALE_S + 1) == f"no heartbeat for {STALE_S + 1:.0f} s"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeued job keeps its id; Slurm ended its processes first
    assert gone(holder, flock_free=False, heartbeat_age=1) == "Slurm requeued job 4242"
    this_host = {**holder, "host": socket.gethostname(), "pid": os.getpid()}
    assert gone(this_host, flock_free=False, heartbeat_age=STALE_S + 1) is None  # on this host the flock decides


def stale_lock_then_train_sh(dump: Path, model: str, data: str) -> subprocess.CompletedProcess:
    """A background job: a lock left by a run whose process is gone, then train.sh on 2 steps there."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    dump.mkdir()
    holder = {"host": socket.gethostname(), "pid": ended.pid, "started": time.time() - 3600, "slurm_job_id": "",
              "attempt": 1, "command": "torchrun -m flame.train (killed)"}
    (dump / LOCK_FILE).write_text(json.dumps(holder))
    (dump.parent / "holder.json").write_text(json.dumps(holder))
    return finish(train_sh(*base_args(model, data, dump, steps=2), "--checkpoint.no-enable"))


@pytest.mark.background_runs(stale=stale_lock_then_train_sh)
def test_the_lock_of_a_run_that_is_gone_is_taken_over_with_a_warning(background_runs):
    dump, result = background_runs["stale"]
    check(result)
    holder = json.loads((dump.parent / "holder.json").read_text())
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    warnings = [line for line in result.stderr.splitlines() if "warning: taking over" in line]
    assert warnings == [f"flame: warning: taking over the lock of {dump} from a run that is gone (host "
                        f"{holder['host']}, pid {holder['pid']}, since {since}): it has ended (its lock is free)"]
    assert (dump / LOCK_FILE).read_text() == ""


def test_the_launcher_imports_what_ranks_import_but_not_fla_so_that_it_can_fork_them():
    # fla's import asks the GPU for its name, which starts CUDA: a process forked after it cannot use the GPU
    probe = ("import json, sys; from flame.launch import supervise; method = supervise.warm_up(); "
             "print(json.dumps([method, 'fla' in sys.modules, 'flame.training.trainer' in sys.modules, 'torchtitan.train' in sys.modules]))")
    result = check(subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=flame_env(), capture_output=True,
                                  text=True, timeout=300))
    assert json.loads(result.stdout.splitlines()[-1]) == ["fork", False, True, True]


def test_ranks_forked_by_the_launcher_train_as_spawned_ones_do(tmp_path, tiny_model, corpus):
    def launch(name: str, cuda_started: str | None) -> tuple[Path, str]:
        dump = tmp_path / name
        code = (f"import sys; from flame.launch import supervise; supervise.cuda_started = lambda: {cuda_started!r}; "
                "sys.exit(supervise.main(sys.argv[1:]))")
        command = [sys.executable, "-c", code, "--world-size", "2", "--", "--standalone", "--nproc_per_node", "2",
                   "-m", "flame.train", *base_args(tiny_model, corpus, dump, steps=3), "--checkpoint.no-enable"]
        result = check(subprocess.run(command, cwd=ROOT, env=flame_env(), capture_output=True, text=True, timeout=300))
        return dump, result.stderr

    forked, forked_log = launch("forked", None)
    spawned, spawned_log = launch("spawned", "a GPU library was imported")  # as if CUDA had started
    assert "start fresh" not in forked_log
    assert ("flame: warning: the ranks start fresh (spawned), each importing torch again: a GPU library was "
            "imported") in spawned_log
    forked, spawned = metrics(forked), metrics(spawned)
    assert sorted(forked) == [1, 2, 3]
    loss = "loss_metrics/global_avg_loss"
    assert [forked[step][loss] for step in forked] == [spawned[step][loss] for step in forked]

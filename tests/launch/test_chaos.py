"""Fault injection, the smallest run of each scripts/chaos case: a kill mid-save, a damaged checkpoint,
two runs on one dump folder, stop signals, a full disk at a save. The long version is
``python -m scripts.chaos --kills 20 --procs 1,2``.

Every run is the debug job through ``bash train.sh``, 4 steps with a checkpoint every 2 (rows of
64 tokens, so that start-up is most of a run), in one process, against one uninterrupted reference.
"""

import os
import random
import re
import signal
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pytest

from scripts.chaos import damage, kills, signals, two_runs, writes
from scripts.chaos.runs import (
    Attempt,
    Job,
    Reference,
    descendants,
    leftovers,
    losses,
    metric_lines,
    run_reference,
)
from tests.conftest import two_at_a_time

FAST = ["--training.seq_len", "64", "--training.batch_size", "2"]
GRACE = 5  # seconds a killed run's processes get to die


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    work = tmp_path_factory.mktemp("chaos_reference")
    return run_reference(Job(work / "dump", procs=1, steps=4, interval=2, extra=FAST), work / "run")


class Cases(NamedTuple):
    killed_mid_save: kills.Trial  # killed (kill -9 of train.sh's process group) while saving, then resumed
    truncated: damage.Damage  # a copy of the reference, a .distcp of its latest step cut in half, resumed
    two_runs: two_runs.TwoRuns  # two runs started together on one new dump folder


@pytest.fixture(scope="module")
def cases(reference, tmp_path_factory) -> Cases:
    """Every case's runs, the kill trial beside the other two (a run is mostly one busy core)."""
    work = tmp_path_factory.mktemp("chaos")
    trial = partial(kills.run_trial, "mid-save", reference, [kills.MID_SAVE], work, random.Random(0), GRACE, False)

    def damage_then_two_runs() -> tuple[damage.Damage, two_runs.TwoRuns]:
        return damage.run_case("truncate-distcp", reference, work, random.Random(0), False), \
            two_runs.run_two(reference, work, False)

    killed, (truncated, shared) = two_at_a_time(trial, damage_then_two_runs)
    return Cases(killed, truncated, shared)


def test_a_run_killed_mid_save_resumes_to_the_losses_of_an_uninterrupted_run(cases):
    [kill] = cases.killed_mid_save.kills
    assert kill.landed and kill.mid_save, kill.where
    trial = cases.killed_mid_save
    assert trial.resumed and trial.identical, trial.problems
    assert trial.export_ok and not trial.staging_left, trial.problems


def test_killing_train_sh_stops_every_process_of_the_run(cases):
    # torchrun starts each rank in a session of its own: a kill of train.sh's group does not reach it
    [kill] = cases.killed_mid_save.kills
    assert kill.landed and not kill.orphans, kill.orphans


def test_a_truncated_checkpoint_is_named_and_the_run_falls_back_to_the_previous_step(cases):
    result = cases.truncated
    assert result.detected, f"{result.file} not named without a traceback: {result.problems}"
    assert result.fell_back and result.identical, result.problems


def test_a_second_run_on_one_dump_folder_is_refused_in_one_line(cases):
    result = cases.two_runs
    assert result.one_ran and result.refused, result.problems
    assert result.intact, result.problems


@pytest.fixture(scope="module")
def stops(reference, tmp_path_factory) -> list[signals.SignalTrial]:
    """A terminal's Ctrl-C (SIGINT to train.sh's process group), SIGINT to the launcher alone, and Slurm's SIGTERM to
    the process group, each at a seeded step, then the same command again."""
    work = tmp_path_factory.mktemp("signals")
    trial = partial(signals.run_signal_trial, reference=reference, work=work, keep=False)
    return two_at_a_time(
        partial(trial, "ctrl-c", sig=signal.SIGINT, target="group", rng=random.Random(1)),
        partial(trial, "sigusr1-launcher", sig=signal.SIGUSR1, target="launcher", rng=random.Random(2)),
        partial(trial, "slurm-sigterm", sig=signal.SIGTERM, target="group", rng=random.Random(3)))


def test_a_stop_signal_saves_the_step_taken_and_the_resume_is_bit_identical(stops):
    for trial in stops:
        assert trial.landed and trial.status == 128 + getattr(signal, trial.signal), (trial.name, trial.problems)
        assert not trial.console_traceback and trial.reported, (trial.name, trial.problems)
        assert trial.saved == trial.last_logged and trial.lost_steps == 0, (trial.name, trial.problems)
        assert trial.resumed and trial.identical, (trial.name, trial.problems)


def test_a_second_signal_stops_at_once(reference, tmp_path):
    # full-size rows: a step and the stop's save take long enough for the second signal to land before they end
    job = Job(tmp_path / "dump", 1, 50, 100)
    attempt = Attempt(job, tmp_path / "attempt")
    while attempt.running() and not losses(metric_lines(job.dump))[0]:
        time.sleep(0.05)
    launcher = signals.launcher_pid(attempt)
    os.kill(launcher, signal.SIGTERM)
    # the second once the first is handled (two sent at once are one: the kernel keeps one pending SIGTERM)
    while attempt.running() and "finishing the current step" not in attempt.stderr:
        time.sleep(0.002)
    os.kill(launcher, signal.SIGTERM)
    status = attempt.wait(120)
    assert status == 128 + signal.SIGKILL, attempt.stderr[-2000:]
    assert "stopped at once by a second signal" in attempt.stderr and "Traceback" not in attempt.stdout + attempt.stderr
    assert not leftovers(job.dump, [])


def test_a_full_disk_at_a_save_costs_only_that_save(reference, tmp_path):
    # DCP's writer fails the first save with ENOSPC (scripts/chaos/writes.py); the next interval saves again
    result = writes.run_case("full-disk-at-a-save", reference, tmp_path, False)
    assert result.status == 0 and result.said and not result.traceback, result.problems
    assert result.identical and not result.problems, result.problems


def test_a_lost_rank_is_named_in_one_line_without_a_traceback(tmp_path):
    job = Job(tmp_path / "dump", 2, 200, 100, FAST)
    attempt = Attempt(job, tmp_path / "attempt")
    while attempt.running() and not losses(metric_lines(job.dump))[0]:
        time.sleep(0.05)
    [rank1] = [p.pid for p in descendants(attempt.process.pid) if _name(p.pid) == "flame-rank1"]
    os.kill(rank1, signal.SIGKILL)  # what the host's out-of-memory killer does
    assert attempt.wait(120) == 1
    console = attempt.stdout + attempt.stderr
    assert "flame: training failed: rank 1 was killed by SIGKILL" in attempt.stderr, console[-2000:]
    assert "Traceback" not in console
    assert not leftovers(job.dump, [])


def test_a_hung_rank_is_named_by_the_launcher_though_another_rank_reports_the_timeout(tmp_path):
    job = Job(tmp_path / "dump", 2, 200, 100, [*FAST, "--comm.train_timeout_seconds", "10"])
    attempt = Attempt(job, tmp_path / "attempt")
    while attempt.running() and len(losses(metric_lines(job.dump))[0]) < 3:
        time.sleep(0.05)
    [rank1] = [p.pid for p in descendants(attempt.process.pid) if _name(p.pid) == "flame-rank1"]
    os.kill(rank1, signal.SIGSTOP)  # frozen: rank 0's next collective times out, rank 1 reports nothing
    assert attempt.wait(180) == 1
    console = attempt.stdout + attempt.stderr
    assert "flame: training failed: rank 0 exited with status 1: rank 0 failed: a collective timed out" in console, \
        console[-2000:]
    # frozen inside a step, or before starting the one rank 0 went on to: either way rank 1 is the one waited for
    named = "rank 1 stopped answering" in console or "rank 1 never started step" in console
    assert named and "the others waited for it" in console, console[-2000:]
    assert "Traceback" not in console
    assert not leftovers(job.dump, [])


def test_a_killed_data_loader_worker_is_named_with_its_likely_cause(tmp_path):
    job = Job(tmp_path / "dump", 1, 200, 100, [*FAST, "--training.num_workers", "2"])
    attempt = Attempt(job, tmp_path / "attempt")
    while attempt.running() and not losses(metric_lines(job.dump))[0]:
        time.sleep(0.05)
    worker = next(p.pid for p in descendants(attempt.process.pid) if _name(p.pid) == "pt_data_worker")
    os.kill(worker, signal.SIGKILL)
    assert attempt.wait(120) == 1
    console = attempt.stdout + attempt.stderr
    # torch says "killed by signal" where its SIGCHLD handler saw the worker's status first, else "exited unexpectedly"
    assert re.search(rf"its data-loader worker \(pid {worker}\) (was killed by signal: Killed|exited unexpectedly): ",
                     console), console[-2000:]
    assert "out-of-memory killer" in console and "Traceback" not in console
    assert not leftovers(job.dump, [])


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""

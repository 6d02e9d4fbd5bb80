"""A write that fails costs only itself: a checkpoint save (retried at the next interval; the last one stops the run
in one line), metrics.jsonl, TensorBoard, the trace folders. The saves fail through scripts/chaos/writes.py's fault."""

import logging
import os

import pytest
from torchtitan.components.metrics import BaseLogger

from flame.checkpoint.manifest import complete_steps
from flame.launch import summary
from flame.training.side_outputs import NonFatalLogger
from scripts.chaos import writes
from tests.conftest import base_args, check, flame_env, metrics, torchrun


def _failing_saves(steps: list[int], *flags: str, nproc: int = 1):
    """4 steps saved every 2, the saves of ``steps`` failing on the last rank as on a full disk (ENOSPC, after part of
    its file: scripts/chaos/writes.py's fault)."""
    def job(dump, model, data):
        faults = writes.fault_env(dump.parent / "faults", steps)
        env = faults | {"PYTHONPATH": f"{flame_env()['PYTHONPATH']}:{faults['PYTHONPATH']}"}
        return torchrun(base_args(model, data, dump, steps=4) + ["--checkpoint.interval=2", *flags], nproc=nproc, env=env)
    return job


def _unwritable_side_outputs(dump, model, data):
    dump.mkdir()
    os.symlink("/dev/full", dump / "metrics.jsonl")  # every write: "No space left on device"
    (dump / "tb").write_text("a file where TensorBoard's folder goes")
    (dump / "comm_traces").write_text("a file where the flight recorder's folder goes")
    return torchrun(base_args(model, data, dump, steps=2) + ["--metrics.enable_tensorboard"])


# a data-loading worker: a failed save must leave nothing that keeps it alive (the rank would wait for it at exit)
@pytest.mark.background_runs(run=_failing_saves([2], "--training.num_workers=1", nproc=2))
def test_a_save_that_cannot_be_written_is_retried_at_the_next_interval(background_runs):
    dump, result = background_runs["run"]
    check(result)
    output = result.stdout + result.stderr
    assert (f"checkpoint step-2 was not saved (rank 1: No space left on device: {dump}/checkpoint/step-2/__1_0.distcp); "
            "its partial files were removed; there is no complete checkpoint yet; training goes on, and the last step's "
            "save (step 4) tries again") in output
    assert complete_steps(str(dump / "checkpoint")) == [4] and not (dump / "checkpoint" / "step-2").exists()
    assert sorted(metrics(dump)) == [1, 2, 3, 4]


@pytest.mark.background_runs(run=_failing_saves([2, 4], "--checkpoint.async_mode=async"))
def test_a_last_save_that_cannot_be_written_stops_the_run_in_one_line(background_runs):
    dump, result = background_runs["run"]
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "checkpoint step-2 was not saved (No space left on device: " in output and ", in the background)" in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("flame: error:")]
    assert errors == [
        f"flame: error: checkpoint step-4 was not saved (No space left on device: {dump}/checkpoint/step-4/__0_0.distcp); "
        "its partial files were removed; there is no complete checkpoint yet; the run trained to step 4, but that step "
        "is not saved, so nothing was exported: fix that, then run the same command again (it resumes from the latest "
        "complete checkpoint and trains the rest)"
    ]
    assert os.listdir(dump / "checkpoint") == []
    assert "Traceback" not in result.stderr.split("flame: error:")[0]  # the rank said it in one line


@pytest.mark.background_runs(run=_unwritable_side_outputs)
def test_metrics_tensorboard_and_traces_that_cannot_be_written_cost_no_training(background_runs):
    dump, result = background_runs["run"]
    check(result)
    output = result.stdout + result.stderr
    assert f"{dump}/metrics.jsonl, step 1: not written (OSError: No space left on device)" in output
    assert f"TensorBoard/W&B: the folder {dump}/tb cannot be made (NotADirectoryError" in output
    assert f"communication traces: the folder {dump}/comm_traces cannot be made (FileExistsError" in output
    assert complete_steps(str(dump / "checkpoint")) == [2]


class _Flaky(BaseLogger):
    def __init__(self, failing: set[int]):
        self.failing, self.logged = failing, []

    def log(self, metrics, step):
        if step in self.failing:
            raise OSError(28, "No space left on device")
        self.logged.append(step)


def test_a_metrics_output_warns_once_and_says_which_steps_it_lacks(caplog):
    inner = _Flaky({2, 3})
    output = NonFatalLogger(inner, "metrics.jsonl x")
    with caplog.at_level(logging.INFO):
        for step in range(1, 6):
            output.log({"loss": 1.0}, step)
    assert inner.logged == [1, 4, 5]
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["metrics.jsonl x, step 2: not written (OSError: No space left on device); training goes on "
                        "without it, and says when this output is written again",
                        "metrics.jsonl x: written again from step 4; it lacks the steps logged from 2 to 3"]


def test_a_stop_whose_save_failed_says_where_training_resumes():
    record = {"signal": "SIGTERM", "step": 7, "saved": False,
              "failed": "checkpoint step-7 was not saved (No space left on device); the latest complete checkpoint is step-4"}
    line = summary.stopped(record, ["--job.dump_folder", "exp/x"])
    assert line.startswith("flame: stopped by SIGTERM: checkpoint step-7 was not saved (No space left on device); the "
                           "latest complete checkpoint is step-4, where training resumes; resume with: ")

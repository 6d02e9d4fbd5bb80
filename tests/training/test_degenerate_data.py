"""Degenerate data never trains silently: a step without targets or with a non-finite loss is a non-finite step,
skipped or fatal as --training.skip_nan_inf says, and a run that took no update fails instead of exporting.

Real tiny runs (the background_runs fixture of tests/conftest.py starts them ahead of their tests).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flame.checkpoint.export import load_hf_model_from_dcp
from flame.models.builder import load_model_config
from tests.conftest import ROOT, SCRIPTS, base_args, check, flame_env, metrics, torchrun, train_job

NO_TARGETS = "its batch has no targets"


def _empty_documents(folder: Path, column: str) -> str:
    """A jsonl dataset of 50 empty documents: texts "" or token ids []."""
    path = folder / f"empty_{column}.jsonl"
    path.write_text("".join(json.dumps({column: "" if column == "text" else []}) + "\n" for _ in range(50)))
    return str(path)


def _train_sh_on_empty_texts(dump: Path, model: str, corpus: str) -> subprocess.CompletedProcess:
    # every update skipped (--training.skip_nan_inf) until the last step, which may not end the run untrained
    args = base_args(model, _empty_documents(dump.parent, "text"), dump, steps=3) + [
        "--training.skip_nan_inf", "--checkpoint.interval=2"]
    env = flame_env() | {"FLAME_PYTHON": sys.executable, "NGPU": "1"}
    return subprocess.run(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def _torchrun_on_empty_token_ids(dump: Path, model: str, corpus: str) -> subprocess.CompletedProcess:
    return torchrun(base_args(model, _empty_documents(dump.parent, "input_ids"), dump, steps=3))


def _bad_loss_job(*flags: str):
    """6 steps whose step 3 has a NaN loss and finite gradients (tests/scripts/inject_nonfinite.py)."""
    return train_job(6, "--checkpoint.interval=1", *flags, module=str(SCRIPTS / "inject_nonfinite.py"),
                     env={"FLAME_TEST_BAD_STEPS": "3", "FLAME_TEST_BAD": "loss"})


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """The one-line refusals the ranks printed (train.sh prefixes a rank's lines with its name)."""
    return [line.partition("flame: error: ")[2] for line in (result.stdout + result.stderr).splitlines()
            if "flame: error: " in line]


def _weights(dump: Path, step: int, model_config: str) -> dict:
    return load_hf_model_from_dcp(str(dump / "checkpoint" / f"step-{step}"), load_model_config(model_config)).state_dict()


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.background_runs(run=_train_sh_on_empty_texts)
def test_a_run_on_empty_texts_that_skips_every_update_fails_in_one_line_and_exports_nothing(background_runs):
    dump, result = background_runs["run"]
    assert result.returncode != 0
    assert "step 1: its batch has no targets" in result.stdout + result.stderr  # skipped, as the policy says
    [line] = _error_lines(result)
    assert line.startswith(f"step 3: {NO_TARGETS}") and "every one of the run's 3 updates was skipped" in line, line
    assert "Check the data" in line and "step-2, the last checkpoint, is intact" in line
    assert not (dump / "checkpoint" / "step-3").exists()  # its last step is not saved as the run's result
    assert not (dump / "hf").exists()


@pytest.mark.background_runs(run=_torchrun_on_empty_token_ids)
def test_a_step_without_targets_stops_a_run_that_does_not_skip(background_runs):
    dump, result = background_runs["run"]
    assert result.returncode != 0
    [line] = _error_lines(result)
    assert line.startswith(f"step 1: {NO_TARGETS}") and "no checkpoint was saved" in line, line
    assert "--training.skip_nan_inf" not in line  # skipping does not fix data: the fix named is the data's
    assert not (dump / "checkpoint").exists() or not any((dump / "checkpoint").iterdir())


@pytest.mark.background_runs(run=_bad_loss_job("--training.skip_nan_inf"))
def test_a_non_finite_loss_skips_its_update_under_skip_nan_inf(background_runs, tiny_model):
    # fused AdamW (the default): the optimizer skips it without a host wait, the skip is counted at the next read
    dump, result = background_runs["run"]
    check(result)
    assert "step 3: loss is nan; update skipped (non-finite; 1 skipped so far)" in result.stdout + result.stderr
    rows = metrics(dump)
    assert [rows[step]["skipped_steps"] for step in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert math.isfinite(rows[3]["grad_norm"])  # the gradients were finite: the loss alone made the step unsound
    weights = {step: _weights(dump, step, tiny_model) for step in (2, 3, 4)}
    assert _same_weights(weights[2], weights[3]) and not _same_weights(weights[3], weights[4])


@pytest.mark.background_runs(run=_bad_loss_job("--optimizer.implementation=foreach"))
def test_a_non_finite_loss_stops_the_run_by_default_naming_its_step(background_runs):
    # foreach AdamW: judged on the host at every step. The injecting script runs the Trainer itself, without
    # flame.train's one-line print: the error's own text is the line
    dump, result = background_runs["run"]
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "UpdatesFailingError: step 3: loss is nan; stopping, step-2, the last checkpoint, is intact" in output
    assert "or pass --training.skip_nan_inf to skip such updates" in output
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file() and not (dump / "checkpoint" / "step-3").exists()

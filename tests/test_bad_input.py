"""Bad input fails in one line, naming the setting and the fix, before any training process starts.

Each case runs train.sh's preflight (``python -m flame.launch``) in this process: exit 2, one
line on stderr, and nothing written into the dump folder.
"""

import os
import subprocess

import pytest

from flame import launch
from tests.conftest import ROOT, TOKENIZER, flame_env, write_job_toml


@pytest.fixture
def job(tmp_path, tiny_model):
    """A valid job (its TOML and dump folder) that each case breaks in one place."""
    toml = write_job_toml(tmp_path / "job.toml", tiny_model, "seq_len = 64\nsteps = 4")
    return ["--job.config_file", str(toml), "--job.dump_folder", str(tmp_path / "run")]


def preflight(args: list[str], tmp_path, capsys) -> tuple[int, str]:
    code = launch.main(["--world-size", "1", "--env-file", str(tmp_path / "plan.sh"), "--", *args])
    return code, capsys.readouterr().err


def assert_refused(args, tmp_path, capsys, *fragments: str) -> None:
    code, err = preflight(args, tmp_path, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flame: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_valid_job_passes(job, tmp_path, capsys):
    assert preflight(job, tmp_path, capsys)[0] == 0


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--training.steps", "0"], ["--training.steps must be >= 1", "--checkpoint.create_seed_checkpoint"]),
        (["--checkpoint.keep_latest_k", "-1"], ["--checkpoint.keep_latest_k -1", "use 0"]),
        (["--optimizer.lr", "-1e-3"], ["--optimizer.lr must be >= 0"]),
        (["--checkpoint.enable", "--checkpoint.load_step", "7"],
         ["--checkpoint.load_step 7", "no complete step-7", "start from step 1"]),
        (["--checkpoint.enable", "--checkpoint.initial_load_path", "/nonexistent/step-3"],
         ["--checkpoint.initial_load_path", "no .metadata"]),
        (["--checkpoint.load_step", "7"], ["--checkpoint.load_step", "checkpointing is off", "--checkpoint.enable"]),
        (["--training.max_skipped_steps", "3"], ["--training.max_skipped_steps limits skipped updates", "--training.spike_sigma"]),
        (["--training.skip_nan_inf", "--training.max_skipped_steps", "-1"], ["--training.max_skipped_steps must be >= 0"]),
    ],
)
def test_impossible_settings_are_refused(job, tmp_path, capsys, flags, fragments):
    assert_refused([*job, *flags], tmp_path, capsys, *fragments)


def test_a_load_step_that_is_not_there_names_the_steps_that_are(job, tmp_path, capsys):
    for step in (2, 4):  # complete checkpoints: DCP writes .metadata last
        (tmp_path / "run" / "checkpoint" / f"step-{step}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoint" / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "run" / "checkpoint" / "step-6").mkdir()  # a save that did not finish
    code, err = preflight([*job, "--checkpoint.enable", "--checkpoint.load_step", "6"], tmp_path, capsys)
    assert code == 2 and "no complete step-6; its complete steps are 2, 4" in err, err


def test_a_second_job_file_is_refused_not_ignored(job, tmp_path, capsys):
    assert_refused([*job, "--job.config_file", job[1]], tmp_path, capsys, "--job.config_file is given 2 times")


def test_a_job_file_that_is_not_toml_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    assert_refused(["--job.config_file", str(bad)], tmp_path, capsys, f"{bad} is not valid TOML", "line 1")


@pytest.mark.parametrize(
    "line, fragments",
    [
        ('steps = "abc"', ["'training.steps'", "'abc'", "integer"]),
        ("varlen = 1", ["'training.varlen'", "boolean"]),
        ('mix_unit = "bytes"', ["'training.mix_unit'", "one of 'documents', 'tokens'"]),
        ("seq_len = 64.5", ["'training.seq_len'", "integer"]),
    ],
)
def test_a_toml_value_of_the_wrong_type_names_its_key(tmp_path, tiny_model, capsys, line, fragments):
    toml = write_job_toml(tmp_path / "job.toml", tiny_model, f"seq_len = 64\n{line}" if "seq_len" not in line else line)
    assert_refused(["--job.config_file", str(toml), "--job.dump_folder", str(tmp_path / "run")], tmp_path, capsys,
                   *fragments)


def test_a_dump_folder_under_a_file_is_refused(job, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    args = [*job[:2], "--job.dump_folder", str(tmp_path / "taken" / "run")]
    assert_refused(args, tmp_path, capsys, "is a file, not a folder")


def test_a_dump_folder_this_user_cannot_write_is_refused(job, tmp_path, capsys, monkeypatch):
    (tmp_path / "locked").mkdir()
    locked = str(tmp_path / "locked")
    real_access = os.access
    # as the kernel answers a user without write permission (root, which runs CI, may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: path != locked and real_access(path, mode))
    args = [*job[:2], "--job.dump_folder", str(tmp_path / "locked" / "run")]
    assert_refused(args, tmp_path, capsys, f"{locked} is not writable by this user")


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"NGPU": "abc"}, "NGPU must be a whole number >= 1, not 'abc'"),
        ({"NGPU": "0"}, "NGPU must be a whole number >= 1, not '0'"),
        ({"NNODE": "two"}, "NNODE must be a whole number >= 1, not 'two'"),
        ({"NNODE": "2", "NODE_RANK": "2"}, "NODE_RANK 2 is not below NNODE 2: number the nodes 0 to 1"),
    ],
)
def test_train_sh_refuses_a_malformed_process_count(environment, message):
    env = {**flame_env(), "FLAME_DRY_RUN": "1", **environment}
    result = subprocess.run(["bash", "train.sh", "--model.tokenizer_path", TOKENIZER], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == f"flame: error: {message}", result.stderr

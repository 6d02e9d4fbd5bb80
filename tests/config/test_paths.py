"""Paths stay home: ``~`` and environment variables expand in every path, and a run's folders stay in its dump folder."""

import logging

import pytest

from flame.base.cli import ArgumentParser
from flame.base.errors import ConfigError
from flame.config.manager import parse
from flame.prepare import prepare_settings

DEBUG_JOB = ["--job.config_file", "configs/debug.toml"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLAME_TEST_SCRATCH", str(tmp_path / "scratch"))
    return tmp_path


def test_tilde_and_variables_expand_in_the_job_file_and_on_the_command_line(home, tmp_path):
    job_file = tmp_path / "home" / "job.toml"
    job_file.parent.mkdir()
    job_file.write_text('[job]\ndump_folder = "~/runs/a"\n[model]\nconfig = "configs/llama_4M.json"\n'
                        '[training]\ndataset = "$FLAME_TEST_SCRATCH/a.jsonl, ~/b.jsonl"\n')
    config = parse(["--job.config_file=~/job.toml", "--model.tokenizer_path", "${FLAME_TEST_SCRATCH}/tok"]).config
    assert config.job.config_file == str(job_file)
    assert config.job.dump_folder == str(home / "home" / "runs" / "a")
    assert config.training.dataset == f"{home}/scratch/a.jsonl, {home}/home/b.jsonl"
    assert config.model.tokenizer_path == f"{home}/scratch/tok"
    assert config.model.config == "configs/llama_4M.json"  # a path without either is left as written


def test_a_variable_that_is_not_set_is_refused_not_kept_as_a_folder_name(home):
    with pytest.raises(ConfigError, match=r"--job.dump_folder \$FLAME_NO_SUCH_VARIABLE/run names the environment "
                                          "variable FLAME_NO_SUCH_VARIABLE, which is not set"):
        parse([*DEBUG_JOB, "--job.dump_folder", "$FLAME_NO_SUCH_VARIABLE/run"])
    with pytest.raises(ConfigError, match="there is no user 'flame_no_such_user'"):
        parse([*DEBUG_JOB, "--checkpoint.folder", "~flame_no_such_user/ckpt"])


def test_the_subcommands_path_arguments_expand_too(home, capsys):
    parser = ArgumentParser(prog="flame test")
    parser.add_argument("--out", path=True)
    parser.add_argument("--sample")
    args = parser.parse_args(["--out=~/hf", "--sample", "$HOME"])
    assert args.out == f"{home}/home/hf" and args.sample == "$HOME"  # a prompt is no path
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "$FLAME_NO_SUCH_VARIABLE/hf"])
    assert "the environment variable FLAME_NO_SUCH_VARIABLE, which is not set" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--checkpoint.folder", "--metrics.save_tb_folder", "--comm.save_traces_folder",
                                  "--profiling.save_traces_folder", "--job.save_config_file"])
def test_a_folder_of_the_run_may_not_leave_its_dump_folder(flag, tmp_path):
    args = [*DEBUG_JOB, "--job.dump_folder", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=f"{flag} ../../x leaves the dump folder .*--job.allow_absolute_folders"):
        prepare_settings(parse([*args, flag, "../../x"]), world_size=1)
    with pytest.raises(ConfigError, match=f"{flag} {tmp_path}/x is outside the dump folder"):
        prepare_settings(parse([*args, flag, str(tmp_path / "x")]), world_size=1)


def test_absolute_folders_elsewhere_need_the_opt_in_and_are_logged(tmp_path, caplog):
    args = [*DEBUG_JOB, "--job.dump_folder", str(tmp_path / "run")]
    prepare_settings(parse([*args, "--checkpoint.folder", str(tmp_path / "run" / "ckpt")]), world_size=1)  # inside
    prepare_settings(parse([*args, "--checkpoint.folder", "sub/../ckpt"]), world_size=1)
    with caplog.at_level(logging.INFO):
        job = parse([*args, "--checkpoint.folder", str(tmp_path / "big-disk"), "--job.allow_absolute_folders"])
        prepare_settings(job, world_size=1)
    assert f"--checkpoint.folder {tmp_path}/big-disk: outside the dump folder" in caplog.text

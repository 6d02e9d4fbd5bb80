"""A dataset given on the command line replaces the job file's, and with it what the job file says of its
datasets (dataset_name, split, data_dir, data_files, data_format, data_probs, text_column): those go back
to their defaults, with one logged line naming them (flame.config.merge.DATASET_DEPENDENTS)."""

import logging
from pathlib import Path

import pytest

from flame.config.manager import parse
from flame.config.merge import DATASET_DEPENDENTS
from flame.data.sources import load_source, source_specs
from tests.conftest import ROOT

JOB = """
[training]
dataset = "HuggingFaceFW/fineweb-edu"
dataset_name = "sample-100BT"
dataset_split = "train[:90%]"
data_files = "sample/100BT/*.parquet"
data_probs = "1.0"
text_column = "content"
steps = 10
[validation]
dataset = "HuggingFaceFW/fineweb-edu"
dataset_name = "sample-10BT"
data_format = "text"
"""


@pytest.fixture
def job_toml(tmp_path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


def reset_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "replaces the job file's datasets" in record.getMessage()]


def test_the_job_files_dataset_settings_are_reset_when_the_command_line_names_another_dataset(job_toml, caplog):
    caplog.set_level(logging.INFO)
    job = parse(["--job.config_file", str(job_toml), "--training.dataset", "data/*.jsonl"])
    training = job.config.training
    assert training.dataset == "data/*.jsonl"
    assert (training.dataset_name, training.dataset_split, training.data_files, training.data_probs,
            training.text_column) == (None, None, None, None, None)
    assert training.steps == 10  # not a setting of the dataset: the job file's stays
    assert job.config.validation.dataset_name == "sample-10BT"  # the validation set is another option's
    assert not any(name in job.given for name in DATASET_DEPENDENTS["training.dataset"])
    [line] = reset_lines(caplog)
    assert line.startswith("--training.dataset on the command line")
    for setting in ('training.dataset_name (was "sample-100BT")', "training.dataset_split", "training.data_files",
                    "training.data_probs", "training.text_column"):
        assert setting in line, setting
    assert "give it on the command line" in line


def test_a_dataset_setting_the_command_line_gives_too_is_kept(job_toml, caplog):
    caplog.set_level(logging.INFO)
    job = parse(["--job.config_file", str(job_toml), "--training.dataset", "org/other", "--training.dataset_name", "en"])
    assert job.config.training.dataset_name == "en" and job.config.training.dataset_split is None
    assert "training.dataset_name" not in reset_lines(caplog)[0]


def test_the_job_files_own_dataset_on_the_command_line_keeps_its_settings(job_toml, caplog):
    caplog.set_level(logging.INFO)
    job = parse(["--job.config_file", str(job_toml), "--training.dataset", "HuggingFaceFW/fineweb-edu"])
    assert job.config.training.dataset_name == "sample-100BT" and job.config.training.text_column == "content"
    assert reset_lines(caplog) == []


def test_a_validation_dataset_on_the_command_line_resets_the_job_files_validation_settings(job_toml, caplog):
    caplog.set_level(logging.INFO)
    job = parse(["--job.config_file", str(job_toml), "--validation.dataset", "val.jsonl"])
    assert job.config.validation.dataset_name is None and job.config.validation.data_format == "text"
    assert job.config.training.dataset_name == "sample-100BT"
    [line] = reset_lines(caplog)
    assert line.startswith("--validation.dataset") and "validation.dataset_name" in line
    assert "validation.data_format" in line  # given in the file, if at its default value


def test_the_shipped_job_with_another_dataset_loads_it():
    """configs/fla.toml names fineweb-edu's sample-100BT; another dataset on the command line must not be asked for
    that configuration (datasets: "BuilderConfig 'sample-100BT' not found")."""
    job = parse(["--job.config_file", str(ROOT / "configs" / "fla.toml"), "--training.dataset", "builtin:python-stdlib"])
    [spec] = source_specs(job.config.training)
    assert spec.name is None
    assert next(iter(load_source(spec, streaming=job.config.training.streaming)))["text"]

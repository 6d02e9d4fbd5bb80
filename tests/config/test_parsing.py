"""Parsing only parses: flame.config reads a job, flame.prepare checks and plans it."""

import json
from pathlib import Path
import subprocess
import sys

import pytest

from flame.base.errors import ConfigError
from flame.config.manager import parse
from flame.prepare import prepare
from tests.conftest import ROOT, flame_env

DEBUG_JOB = ["--job.config_file", "configs/debug.toml"]

IMPORTED_BY_PARSING = """
import json, sys
from flame.config.manager import parse
job = parse(sys.argv[1:])
print(json.dumps({"plan": job.config.memory.plan, "modules": sorted(sys.modules)}))
"""


def test_parsing_a_planned_job_imports_no_planner_parallelism_or_trainer():
    result = subprocess.run([sys.executable, "-c", IMPORTED_BY_PARSING, *DEBUG_JOB, "--memory.plan", "auto",
                             "--memory.gpu_budget_gib", "40"], capture_output=True, text=True, cwd=ROOT, env=flame_env())
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.splitlines()[-1])
    assert parsed["plan"] == "auto"
    layers = ("flame.memory", "flame.distributed", "flame.training", "flame.prepare", "flame.optim", "flame.models")
    imported = [name for name in parsed["modules"] if name.startswith(layers) or name == "torchtitan.train"]
    assert imported == []


def test_parsing_takes_values_that_preparing_refuses(monkeypatch):
    job = parse([*DEBUG_JOB, "--training.seq_len", "-5"])
    assert job.config.training.seq_len == -5 and job.given["training.seq_len"]
    with pytest.raises(ConfigError, match="--training.seq_len must be positive, got -5"):
        prepare(job, world_size=1)


def test_preparing_resolves_what_depends_on_other_settings():
    job = parse([*DEBUG_JOB, "--training.seq_len", "128", "--training.gradient_accumulation_steps", "2"])
    assert job.config.training.context_len is None  # parsed as given
    model = prepare(job, world_size=1)
    assert job.config.training.context_len == 128
    assert job.config.training.global_batch_size == 8 * 2
    assert model.config.model_type == "llama"


def test_a_job_file_under_its_earlier_path_is_found():
    """flame/models/fla.toml, where earlier flame versions kept it, reads configs/fla.toml."""
    old = parse(["--job.config_file", "flame/models/fla.toml"]).config
    new = parse(["--job.config_file", "configs/fla.toml"]).config
    assert Path(old.job.config_file).samefile(ROOT / "configs" / "fla.toml")
    old.job.config_file = new.job.config_file
    assert old.to_dict() == new.to_dict() and old.model.config == "configs/llama_340M.json"

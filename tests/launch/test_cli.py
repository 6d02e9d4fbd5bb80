"""The ``flame`` command of an installed flame: built as a wheel, installed into a folder of its own, run from a
directory that is no checkout. Every subcommand answers ``-h`` and does one real thing; a finished run prints its
summary, and running it again says it is complete.
"""

import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import ROOT, two_at_a_time

SUBCOMMANDS = ("train", "eval", "export", "convert", "plot", "push", "preprocess", "models", "doctor")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """flame as ``pip install`` leaves it (its dependencies from this environment): the installed folder."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: setuptools builds inside the tree it packs
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "exp", "build", "*.egg-info", "__pycache__", ".whl", ".baseline", ".gpu-extra"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(source)], check=True, capture_output=True)
    [wheel] = (work / "dist").glob("flame-*.whl")
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("elsewhere")  # no configs/, train.sh or flame/ here


def flame(installed: Path, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "NGPU": "1"}
    env.pop("FLAME_PYTHON", None)
    env.pop("FLAME_COMMAND", None)
    return subprocess.run([str(installed / "bin" / "flame"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_wheel_ships_the_configs_and_the_launcher(installed):
    assert (installed / "flame" / "configs" / "debug.toml").is_file()
    assert (installed / "flame" / "configs" / "tiny" / "gla.json").is_file()
    assert (installed / "flame" / "configs" / "fla.toml").is_file()  # the checkout's symlink, as a file
    assert (installed / "flame" / "launch" / "train.sh").is_file()
    assert (installed / "bin" / "flame").is_file()


def test_every_subcommand_answers_help(installed, elsewhere):
    listing = flame(installed, elsewhere, "-h")
    assert listing.returncode == 0 and all(f"  {name} " in listing.stdout for name in SUBCOMMANDS), listing.stdout
    # two at a time: each is mostly one core importing
    for name, result in zip(SUBCOMMANDS, two_at_a_time(*(partial(flame, installed, elsewhere, name, "-h")
                                                         for name in SUBCOMMANDS))):
        assert result.returncode == 0, (name, result.stderr[-2000:])
        shown = result.stdout
        assert ("--training.steps" in shown) if name == "train" else (f"flame {name}" in shown), (name, shown[:500])
    unknown = flame(installed, elsewhere, "trian")
    assert unknown.returncode == 2 and "no subcommand 'trian'" in unknown.stderr


def test_each_subcommand_does_its_work_from_outside_a_checkout(installed, elsewhere):
    dump = elsewhere / "run"
    trained = flame(installed, elsewhere, "train", "--job.config_file", "configs/debug.toml", "--training.steps", "4",
                    "--training.seq_len", "64", "--checkpoint.interval", "2", "--job.dump_folder", str(dump))
    assert trained.returncode == 0, trained.stderr[-3000:]
    # the shipped configs resolve from here, and the run ends with its summary
    assert "flame: done: step 4, loss " in trained.stdout, trained.stdout[-2000:]
    assert "logged at step" not in trained.stdout  # the last step is logged whatever log_freq (20 here) says
    assert f"HF model:   {dump / 'hf'}" in trained.stdout and "flame eval --model" in trained.stdout
    assert "Traceback" not in trained.stdout + trained.stderr
    again = flame(installed, elsewhere, "train", "--job.config_file", "configs/debug.toml", "--training.steps", "4",
                  "--training.seq_len", "64", "--checkpoint.interval", "2", "--job.dump_folder", str(dump))
    assert again.returncode == 0 and "already complete at step 4" in again.stdout, again.stdout[-1000:]
    assert "Training starts" not in again.stdout

    # the other subcommands read the finished run, each on its own: two at a time (each is mostly one core importing)
    corpus = elsewhere / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "def f{i}(x):\\n    return x + {i}"}}\n' for i in range(8)))
    tasks = installed / "flame" / "configs" / "eval"
    commands = {
        "export": ("export", str(dump), "--out", str(elsewhere / "exported"), "--dtype", "bfloat16"),
        "plot": ("plot", str(dump), "--out", str(elsewhere / "curves.png")),
        "push": ("push", str(dump), "--repo_id", "someone/flame-debug", "--dry_run"),
        "convert": ("convert", "hf_to_dcp", "--model", str(dump / "hf"), "--checkpoint",
                    str(elsewhere / "imported" / "checkpoint" / "step-0")),
        "eval": ("eval", "--model", str(dump / "hf"), "--tasks", "flame_example_choice", "--include_path", str(tasks),
                 "--limit", "4", "--device", "cpu", "--batch_size", "4", "--output_path", str(elsewhere / "scores")),
        "preprocess": ("preprocess", "--dataset", str(corpus), "--tokenizer", str(dump / "hf"), "--out",
                       str(elsewhere / "tokenized"), "--num_proc", "1"),
        "models": ("models",),
        "doctor": ("doctor", "--no_sizes"),
    }
    results = dict(zip(commands, two_at_a_time(*(partial(flame, installed, elsewhere, *args)
                                                  for args in commands.values()))))
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-2000:])
    assert (elsewhere / "exported" / "config.json").is_file()
    assert (elsewhere / "curves.png").stat().st_size > 10_000
    assert "model.safetensors" in results["push"].stdout
    assert (elsewhere / "imported" / "checkpoint" / "step-0" / ".metadata").is_file()
    assert "flame_example_choice" in results["eval"].stdout
    assert "wrote 8 documents" in results["preprocess"].stdout
    assert "gated_deltanet" in results["models"].stdout
    assert "torchtitan" in results["doctor"].stdout and "GPUs:" in results["doctor"].stdout

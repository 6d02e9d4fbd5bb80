"""Shared fixtures: a tiny llama, a small real-text corpus, and a way to run real training jobs."""

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = "builtin:python-stdlib-bpe"


def flame_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("WANDB_MODE", None)
    return env


# the decoder shape of every tiny HF test model: 2 layers, hidden 64, 4 heads over 2 key/value heads
TINY_DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer llama (hidden 64) over the builtin tokenizer's 4096 ids."""
    path = tmp_path_factory.mktemp("model") / "llama_tiny.json"
    path.write_text(
        json.dumps(
            {"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512, "vocab_size": 4096,
             "tie_word_embeddings": False}
        )
    )
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """400 documents of the builtin Python-stdlib corpus as one jsonl file."""
    from flame.data import builtin

    source = Path(builtin.resolve("builtin:python-stdlib"))
    lines = []
    for shard in sorted(source.glob("*.jsonl")):
        with open(shard) as f:
            lines.extend(line for _, line in zip(range(50), f))
    path = tmp_path_factory.mktemp("data") / "corpus.jsonl"
    path.write_text("".join(lines))
    return str(path)


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory, tiny_model, corpus) -> Path:
    """The dump folder of base_args' 4 steps of the tiny llama in one process: the reference of several layouts."""
    dump = tmp_path_factory.mktemp("reference") / "single"
    check(torchrun(base_args(tiny_model, corpus, dump, steps=4)))
    return dump


def base_args(model: str, data: str, dump: Path, steps: int = 6) -> list[str]:
    return [
        f"--model.config={model}",
        f"--model.tokenizer_path={TOKENIZER}",
        f"--training.dataset={data}",
        "--training.seq_len=64",
        "--training.batch_size=2",
        f"--training.steps={steps}",
        "--optimizer.lr=3e-3",
        "--lr_scheduler.warmup_steps=2",
        "--metrics.log_freq=1",
        "--checkpoint.enable",
        f"--checkpoint.interval={max(steps, 1)}",
        f"--job.dump_folder={dump}",
    ]


def torchrun(args: list[str], nproc: int = 1, module: str = "flame.train", timeout: int = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``module`` (or a script path) under torchrun, ``env`` added to its environment; the result
    keeps stdout+stderr."""
    target = ["-m", module] if not module.endswith(".py") else [module]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args,
    ]
    return subprocess.run(
        command, cwd=ROOT, env=flame_env() | (env or {}), capture_output=True, text=True, timeout=timeout
    )


def two_at_a_time(*jobs):
    """The results of independent jobs (callables), run two at a time: most of a tiny job is
    single-threaded start-up and shutdown, which overlap."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [future.result() for future in futures]


def torchrun_two_at_a_time(jobs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Independent single-process jobs, two at a time."""
    return dict(zip(jobs, two_at_a_time(*(partial(torchrun, args) for args in jobs.values()))))


def first_runs(**jobs: Callable[[Path, str, str], subprocess.CompletedProcess]):
    """Declare the runs a test starts with, each ``job(dump folder, tiny_model, corpus)``; the test reads
    them from ``started``. A module's first such test starts those of all its selected tests, two at a
    time: a tiny run is mostly start-up and shutdown on one core, so runs of later tests overlap the
    earlier tests instead of queueing behind them."""
    def declare(test):
        test.first_runs = jobs
        return test
    return declare


def train_job(steps: int, *flags: str, **options) -> Callable[[Path, str, str], subprocess.CompletedProcess]:
    """A first_runs job: base_args' ``steps`` plus ``flags``, under ``torchrun(..., **options)``."""
    return lambda dump, model, data: torchrun(base_args(model, data, dump, steps=steps) + list(flags), **options)


@pytest.fixture(scope="module")
def _first_runs(request, tmp_path_factory, tiny_model, corpus):
    # the selected tests of this module, in order, each once (however many parameters it has)
    tests = {item.originalname: item.function.first_runs for item in request.session.items
             if getattr(item, "module", None) is request.module and hasattr(item.function, "first_runs")}
    root = tmp_path_factory.mktemp("first_runs")
    futures = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for test, jobs in tests.items():
            (root / test).mkdir()
            for name, job in jobs.items():
                futures[test, name] = root / test / name, pool.submit(job, root / test / name, tiny_model, corpus)
        yield futures
        pool.shutdown(cancel_futures=True)  # the runs of tests a stopped session (-x) will not reach


@pytest.fixture
def started(request, _first_runs) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """This test's first_runs, once finished: run name -> (dump folder, result)."""
    test = request.node.originalname
    return {name: (dump, future.result()) for (owner, name), (dump, future) in _first_runs.items() if owner == test}


def parse_job(monkeypatch, world_size: int, *args: str):
    """The JobConfig the ranks of a ``world_size``-process job would parse from ``args`` (validation included)."""
    from flame.config_manager import (
        FlameConfigManager,  # conftest itself imports no flame module
    )

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return FlameConfigManager().parse_args(list(args))


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def metrics(dump: Path) -> dict[int, dict]:
    """step -> logged metrics, from <dump>/metrics.jsonl (later lines win, as after a resume)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def assert_same_curve(got: dict, expected: dict, rel: float = 1e-4, steps=None) -> None:
    """Logged loss and grad norm equal (relative ``rel``) at ``steps`` (default: the same steps, all)."""
    if steps is None:
        assert sorted(got) == sorted(expected)
        steps = sorted(expected)
    for step in steps:
        for key in ("loss_metrics/global_avg_loss", "grad_norm"):
            assert math.isclose(got[step][key], expected[step][key], rel_tol=rel), (step, key, got[step][key], expected[step][key])


def losses(dump: Path) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in metrics(dump).items()}

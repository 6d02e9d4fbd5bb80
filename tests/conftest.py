"""Shared fixtures: a tiny llama, a small real-text corpus, and ways to run real training jobs.

``torchrun`` runs one job; ``two_at_a_time`` runs the independent jobs a test starts itself side
by side; the ``background_runs`` fixture starts the runs a test declares with
``@pytest.mark.background_runs`` ahead of the test (its docstring says how).
"""

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, TypeVar

import pytest

from flame.base import run_record

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"  # programs tests run in processes of their own; each says how
TOKENIZER = "builtin:python-stdlib-bpe"
T = TypeVar("T")


@pytest.fixture(autouse=True)
def environment_restored():
    """Every test leaves os.environ as it found it: flame's launcher, run in-process by some tests, sets
    WORLD_SIZE as train.sh's preflight does, and a later in-process flame.eval would take it for torchrun's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


def two_at_a_time(*jobs: Callable[[], T]) -> list[T]:
    """The results of independent jobs (callables without arguments), in order, run two at a time.

    For the runs a test starts itself: a tiny CPU run is mostly single-threaded start-up and
    shutdown, so two of them take little longer than one on CI's 2 cores. A job's exception is
    raised here once every job has ended."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [future.result() for future in futures]


# ---------------------------------------------------------------- runs started ahead of their tests

BackgroundJob = Callable[[Path, str, str], subprocess.CompletedProcess]


class BackgroundRun(NamedTuple):
    """A finished background run: its dump folder and its process's result (exit status not checked)."""

    dump: Path
    result: subprocess.CompletedProcess


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "background_runs(**jobs): runs the test needs, started ahead of it (the background_runs fixture)"
    )


def train_job(steps: int, *flags: str, **options) -> BackgroundJob:
    """A background job: base_args' ``steps`` of the tiny llama on the corpus plus ``flags``, under
    ``torchrun(..., **options)``."""
    return lambda dump, model, data: torchrun(base_args(model, data, dump, steps=steps) + list(flags), **options)


@pytest.fixture(scope="module")
def _background_queue(request, tmp_path_factory, tiny_model, corpus) -> dict[str, dict[str, tuple[Path, Future]]]:
    """The background runs of this module's selected tests (test name -> run name -> (dump, future)),
    queued in test order on two workers (see background_runs)."""
    root = tmp_path_factory.mktemp("background_runs")
    queued = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for item in request.session.items:
            marker = item.get_closest_marker("background_runs")
            test = getattr(item, "originalname", None)  # a parametrized test's runs are queued once
            if (getattr(item, "module", None) is not request.module or marker is None
                    or "background_runs" not in item.fixturenames or test in queued):
                continue
            (root / test).mkdir()
            queued[test] = {name: (root / test / name, pool.submit(job, root / test / name, tiny_model, corpus))
                            for name, job in marker.kwargs.items()}
        yield queued
        pool.shutdown(cancel_futures=True)  # the runs of tests a stopped session (-x) will not reach


@pytest.fixture
def background_runs(request, _background_queue) -> dict[str, BackgroundRun]:
    """The finished runs this test declares with ``@pytest.mark.background_runs(name=job, ...)``:
    run name -> BackgroundRun(dump, result).

    What runs when: as the module's first test that uses this fixture begins, the declared runs of
    all the module's selected tests that use it are queued in test order and run two at a time in
    background threads, while the tests go on in the foreground (a test's own processes run beside
    them). A tiny run is mostly single-threaded start-up and shutdown on one core, so the runs of
    later tests overlap the earlier tests instead of queueing behind them. Declare only runs that
    need nothing the test does first; what follows them (a resume, say) runs in the test body.
    Runs not started when the module ends (a session stopped by -x) are cancelled.

    Each job is called as ``job(dump, tiny_model, corpus)`` and returns its CompletedProcess
    (``train_job`` makes the usual one); ``dump`` is a fresh path in a folder of the test's own
    (``dump.parent``), where a job may also write its inputs.

    What the test receives: this fixture waits for the test's own runs only, then returns them.
    A run's exit status is not checked here: the test checks it (``check(result)``) or asserts the
    failure it expects. An exception raised by a job (a timeout, say) is raised here, failing the
    test that declared the run.
    """
    test = request.node.originalname
    if test not in _background_queue:
        raise pytest.UsageError(f"{test} uses background_runs: declare its runs with @pytest.mark.background_runs")
    return {name: BackgroundRun(dump, future.result()) for name, (dump, future) in _background_queue[test].items()}


def write_job_toml(path: Path, model_config: str, training: str, job: str = "") -> Path:
    """A job TOML at ``path`` for ``model_config`` on the builtin corpus and tokenizer; ``training``
    (and ``job``) hold the lines of those tables beyond the dataset."""
    path.write_text(
        f"[job]\n{job}\n[model]\nconfig = \"{model_config}\"\ntokenizer_path = \"{TOKENIZER}\"\n"
        f"[training]\ndataset = \"builtin:python-stdlib\"\n{training}\n"
    )
    return path


def parse_job(monkeypatch, world_size: int, *args: str):
    """The JobConfig the ranks of a ``world_size``-process job would parse from ``args`` (validation included)."""
    from flame.prepare import settled  # conftest itself imports no flame module

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return settled(list(args))


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def metrics(dump: Path) -> dict[int, dict]:
    """step -> logged metrics, from <dump>/metrics.jsonl, read as flame's own readers read it: a step's
    lines (training, validation, eval scores; several attempts after a resume) merged, the latest
    attempt's values winning."""
    return run_record.metrics(str(dump))


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

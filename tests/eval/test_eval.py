"""python -m flame.eval scores as lm-eval's own command line does, on HF exports and on checkpoints in memory;
batching does not change scores; bad tasks fail in one line; training scores its checkpoints in the background."""

import glob
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from flame.base.errors import ConfigError
from tests.conftest import (
    ROOT,
    SCRIPTS,
    TOKENIZER,
    check,
    flame_env,
    parse_job,
    torchrun,
    train_job,
)

TASKS_DIR = str(ROOT / "configs" / "eval")
TASKS = "flame_example_choice,flame_example_text"  # a multiple-choice task and a rolling-loglikelihood one
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
EVAL_FLAGS = ["--eval.tasks=flame_example_choice", f"--eval.include_path={TASKS_DIR}", "--eval.limit=4"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)


def make_export(folder: Path, config: dict) -> Path:
    """A randomly initialized model of ``config`` with the builtin tokenizer, saved as an HF export."""
    import flame
    from flame.data.tokenizer import load_tokenizer
    from flame.models import load_model_config

    flame.register()
    config_file = folder.parent / f"{folder.name}.json"
    config_file.write_text(json.dumps(config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(load_model_config(str(config_file))).save_pretrained(folder)
    load_tokenizer(TOKENIZER).save_pretrained(folder)
    return folder


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 4096,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory) -> Path:
    return make_export(tmp_path_factory.mktemp("eval") / "llama", LLAMA)


def lm_eval_cli(model: Path, out: Path) -> subprocess.CompletedProcess:
    """lm-eval's own command line on ``model``, run in a process of its own."""
    command = [sys.executable, str(SCRIPTS / "lm_eval_cli.py"), "--model", "hf", "--model_args", f"pretrained={model}",
               "--tasks", TASKS, "--include_path", TASKS_DIR, "--device", "cpu", "--batch_size", "4", "--output_path", str(out)]
    return subprocess.run(command, check=False, cwd=ROOT, env=flame_env() | OFFLINE, capture_output=True, text=True, timeout=600)


def flame_eval(*args: str) -> int:
    from flame.eval.__main__ import main

    return main([*args, "--include_path", TASKS_DIR, "--batch_size", "4"])


def results(folder: Path) -> dict:
    """The "results" of the one lm-eval results file under ``folder``."""
    (path,) = glob.glob(str(folder / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]


def assert_same_scores(got: dict, expected: dict) -> None:
    assert set(got) == set(TASKS.split(","))
    for task, scores in expected.items():
        numbers = {k: v for k, v in scores.items() if isinstance(v, (int, float))}
        assert numbers and {k: got[task][k] for k in numbers} == numbers, task  # exactly


def beside(job, *args):
    """``job`` (lm_eval's command line) in a thread while this process runs ``flame_eval(*args)``; both results."""
    with ThreadPoolExecutor(1) as pool:
        cli = pool.submit(job)
        status = flame_eval(*args)
        return status, check(cli.result())


@pytest.fixture(scope="module")
def llama_scores(llama_export, tmp_path_factory) -> tuple[Path, Path]:
    """flame.eval's results folder for the llama export, and lm-eval's command line's (run side by side)."""
    out = tmp_path_factory.mktemp("llama_scores")
    status, _ = beside(lambda: lm_eval_cli(llama_export, out / "cli"), "--model", str(llama_export), "--tasks", TASKS,
                       "--output_path", str(out / "flame"))
    assert status == 0
    return out / "flame", out / "cli"


def test_hf_export_scores_as_lm_eval_command_line(llama_scores):
    flame, cli = llama_scores
    assert_same_scores(results(flame), results(cli))
    assert "flame_example_choice" in (flame / "results.md").read_text()


def test_custom_model_scores_as_lm_eval_command_line(tmp_path):
    example = json.loads((ROOT / "custom_models" / "example_lm" / "config_tiny.json").read_text())
    export = make_export(tmp_path / "example", example)
    status, _ = beside(lambda: lm_eval_cli(export, tmp_path / "cli"), "--model", str(export), "--tasks", TASKS)
    assert status == 0
    assert_same_scores(results(export / "eval"), results(tmp_path / "cli"))  # default: <model>/eval


def files(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.background_runs(run=train_job(2))
def test_checkpoint_scores_as_lm_eval_on_its_export(background_runs, tmp_path):
    from flame.checkpoint import export

    dump = check(background_runs["run"].result) and background_runs["run"].dump
    checkpoints = files(dump / "checkpoint")
    assert export.main(["--path", str(dump), "--out", str(tmp_path / "hf")]) == 0
    status, _ = beside(lambda: lm_eval_cli(tmp_path / "hf", tmp_path / "cli"), "--model", str(dump), "--tasks", TASKS)
    assert status == 0
    assert_same_scores(results(dump / "eval" / "step-2"), results(tmp_path / "cli"))
    assert files(dump / "checkpoint") == checkpoints and not (dump / "hf").exists()  # loaded in memory
    from flame.base import run_record

    logged = run_record.metrics(str(dump))[2]
    assert logged["eval/flame_example_choice/acc"] == results(tmp_path / "cli")["flame_example_choice"]["acc,none"]
    assert "loss_metrics/global_avg_loss" in logged  # the step's training record and its scores, merged


def loglikelihoods(model, tokenizer, batch_size: int) -> list[float]:
    from lm_eval.api.instance import Instance

    from flame.eval.model import FlameLM

    docs = [json.loads(line) for line in (ROOT / "configs" / "eval" / "choice.jsonl").read_text().splitlines()]
    requests = [Instance("loglikelihood", doc, (f"Question: {doc['question']}\nAnswer:", f" {choice}"), i)
                for doc in docs for i, choice in enumerate(doc["choices"])]
    lm = FlameLM(model, tokenizer, rank=0, world_size=1, batch_size=batch_size, logits_cache=False)
    return [logprob for logprob, _ in lm.loglikelihood(requests, disable_tqdm=True)]


@pytest.mark.parametrize("config", ["llama", "example"])
def test_padded_batches_score_as_one_sequence_at_a_time(config, tmp_path):
    from flame.data.tokenizer import load_tokenizer

    spec = LLAMA if config == "llama" else json.loads((ROOT / "custom_models" / "example_lm" / "config_tiny.json").read_text())
    export = make_export(tmp_path / config, spec)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(export).eval(), load_tokenizer(str(export))
    batched, alone = loglikelihoods(model, tokenizer, 8), loglikelihoods(model, tokenizer, 1)
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=0, atol=1e-4)


def test_gpu_batches_are_padded_to_a_dozen_lengths_up_to_4096():
    from flame.eval.model import bucket_length

    lengths = {bucket_length(n) for n in range(1, 4097)}
    assert lengths == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096}
    assert all(n <= bucket_length(n) < max(2 * n, n + 512) for n in range(1, 9000))


def test_model_types_that_ignore_padding_are_scored_one_sequence_at_a_time():
    from flame.eval.model import batch_size_for

    assert batch_size_for(SimpleNamespace(config=SimpleNamespace(model_type="abc")), 64) == 1  # refuses cu_seqlens
    assert batch_size_for(SimpleNamespace(config=SimpleNamespace(model_type="gla")), 64) == 64  # unpads by the mask
    assert batch_size_for(SimpleNamespace(config=SimpleNamespace(model_type="llama")), "auto") == "auto"


def test_unknown_task_is_one_line_naming_close_matches(llama_export, capsys):
    assert flame_eval("--model", str(llama_export), "--tasks", "flame_example_choise") == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("flame.eval: error: unknown lm-eval task 'flame_example_choise'")
    assert "did you mean flame_example_choice" in error


def test_dataset_not_in_the_local_cache_is_one_line(llama_export):
    # piqa, as lm-eval ships it: its dataset is on the hub, which an offline machine cannot reach
    result = subprocess.run([sys.executable, "-m", "flame.eval", "--model", str(llama_export), "--tasks", "piqa"],
                            check=False, cwd=ROOT, env=flame_env() | OFFLINE, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("flame.eval: error: task piqa: baber/piqa is not in the local HF cache")
    assert "HF_HOME" in error and "--include_path" in error


def test_step_of_an_hf_directory_is_refused(llama_export, capsys):
    assert flame_eval("--model", str(llama_export), "--step", "3", "--tasks", TASKS) == 2
    assert "is an HF model directory, not a dump folder" in capsys.readouterr().err


@pytest.mark.background_runs(run=train_job(2, *EVAL_FLAGS))
def test_training_scores_its_checkpoints_in_the_background(background_runs):
    from flame.base import run_record

    run = background_runs["run"]
    check(run.result)
    assert (run.dump / "eval" / "step-2" / "results.md").is_file()
    logged = run_record.metrics(str(run.dump))[2]
    assert 0 <= logged["eval/flame_example_choice/acc"] <= 1 and "loss_metrics/global_avg_loss" in logged
    assert "step 2 scores: flame_example_choice/acc" in run.result.stdout + run.result.stderr


def test_evaluation_during_training_needs_checkpoints(tiny_model, corpus, monkeypatch, tmp_path):
    args = [f"--model.config={tiny_model}", f"--model.tokenizer_path={TOKENIZER}", f"--training.dataset={corpus}",
            f"--job.dump_folder={tmp_path}", *EVAL_FLAGS]
    with pytest.raises(ConfigError, match="--eval.tasks scores saved checkpoints, and this run saves none"):
        parse_job(monkeypatch, 1, *args)
    with pytest.raises(ConfigError, match="--eval.interval 3 must be a positive multiple of --checkpoint.interval 2"):
        parse_job(monkeypatch, 1, *args, "--checkpoint.enable", "--checkpoint.interval=2", "--eval.interval=3")


def test_two_processes_give_the_scores_of_one(llama_export, llama_scores, tmp_path):
    # each of two gloo processes scores half of the requests; rank 0 gathers and writes
    args = ["--model", str(llama_export), "--tasks", TASKS, "--include_path", TASKS_DIR, "--batch_size", "4",
            "--output_path", str(tmp_path / "two")]
    check(torchrun(args, nproc=2, module="flame.eval", env=OFFLINE))
    assert_same_scores(results(tmp_path / "two"), results(llama_scores[0]))


def test_a_step_waiting_for_its_evaluation_is_not_purged(tmp_path):
    """--checkpoint.keep_latest_k leaves the steps the background evaluations have yet to read, until a later save."""
    import queue

    from flame.checkpoint.manager import FlameCheckpointManager
    from flame.training.evaluation import BackgroundEvaluations

    # tasks: the evaluation's log line names them (without, it fails at once, and its step stops being pending)
    config = SimpleNamespace(job=SimpleNamespace(dump_folder=str(tmp_path)), eval=SimpleNamespace(interval=0, tasks="t"))
    messages = []
    log = SimpleNamespace(info=messages.append, warning=messages.append)
    evaluations = BackgroundEvaluations(config, "cpu", log)
    release = tmp_path / "release"  # the evaluation runs until this file exists
    evaluations.command = lambda step: [sys.executable, "-c", "import os, time\n"
                                        f"while not os.path.exists({str(release)!r}): time.sleep(0.05)"]
    checkpoint = tmp_path / "checkpoint"
    for step in (2, 4, 6, 8):
        (checkpoint / f"step-{step}").mkdir(parents=True)
    evaluations.saved(str(checkpoint / "step-4"))
    manager = SimpleNamespace(keep_latest_k=2, folder=str(checkpoint), purge_queue=queue.Queue(),
                              steps_in_use=evaluations.pending)
    try:
        FlameCheckpointManager._purge_stale_checkpoints(manager)
        assert list(manager.purge_queue.queue) == [str(checkpoint / "step-2")]
        (checkpoint / manager.purge_queue.get()).rmdir()  # as torchtitan's purge thread does
        release.touch()
        evaluations.queue.join()
        assert evaluations.pending() == set()
        FlameCheckpointManager._purge_stale_checkpoints(manager)  # the next save's purge
        assert list(manager.purge_queue.queue) == [str(checkpoint / "step-4")]
    finally:
        release.touch()
        evaluations.close(wait=True)

"""train.sh as users run it: preflight, torchrun, per-rank logs, HF export on success only."""

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import ROOT, SCRIPTS, TOKENIZER, flame_env, parse_job, two_at_a_time


def train_sh(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = flame_env() | {"FLAME_PYTHON": sys.executable, "NGPU": "1"} | (env_extra or {})
    return subprocess.run(["bash", str(ROOT / "train.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def job_toml(tmp_path, tiny_model, corpus, steps=4, extra=""):
    path = tmp_path / "job.toml"
    path.write_text(
        f"""
[job]
dump_folder = "{tmp_path / 'dump'}"
[model]
config = "{tiny_model}"
tokenizer_path = "{TOKENIZER}"
[training]
dataset = "{corpus}"
seq_len = 64
batch_size = 2
steps = {steps}
[checkpoint]
enable = true
interval = 2
[metrics]
log_freq = 1
{extra}
"""
    )
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, corpus) -> tuple[Path, subprocess.CompletedProcess]:
    """train.sh on job_toml's 4 steps (checkpoints at steps 2 and 4): its job file and its result."""
    job = job_toml(tmp_path_factory.mktemp("train_sh"), tiny_model, corpus)
    return job, train_sh("--job.config_file", str(job))


def test_trains_and_exports_to_the_dump_folder_named_only_in_toml(trained):
    job, result = trained
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    dump = job.parent / "dump"
    assert (dump / "hf" / "config.json").is_file() and (dump / "hf" / "model.safetensors").is_file()
    assert "exported step 4" in result.stdout
    assert list((dump / "logs").rglob("stdout.log")), "per-rank logs under <dump>/logs"


def test_a_run_leaves_its_curves_and_a_model_card(trained):
    from transformers import AutoModelForCausalLM

    from flame.tools import plot
    from tests.conftest import metrics

    job, result = trained
    dump = job.parent / "dump"
    assert (dump / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot.figure([plot.Run.load(str(dump))])
    assert [ax.get_title() for ax in fig.axes] == ["loss (nats/token)", "learning rate", "gradient norm (L2, before clipping)",
                                                    "throughput (tokens/s per device)"]
    assert [axis.get_xlabel() for axis in fig.axes[0].child_axes] == ["tokens trained"]  # one column, tokens on top

    card = (dump / "hf" / "README.md").read_text()
    last = metrics(dump)[4]
    model = AutoModelForCausalLM.from_pretrained(dump / "hf")
    for line in ("| model_type | `llama` |", "| layers | 2 |", "| hidden size | 64 |", "| attention heads | 4 |",
                 "| key/value heads | 2 |", "| vocabulary | 4,096 |", f"| parameters | {model.num_parameters():,} ",
                 "| steps | 4 |", f"| tokens trained | {last['n_tokens_seen']:,} |",
                 f"| training loss | {last['loss_metrics/global_avg_loss']:.4f} at step 4 ",
                 "| context trained | documents of up to 64 tokens, rows of 64 |",
                 "NGPU=1 bash train.sh --job.config_file job.toml", "trained with flame "):
        assert line in card, line
    assert "corpus.jsonl` | split train |" in card and "validation" not in card and "## Evaluation" not in card


def test_the_model_card_shows_validation_and_eval_scores_when_the_run_has_them(trained, tmp_path):
    import shutil

    from flame.checkpoint import export

    dump = tmp_path / "dump"
    shutil.copytree(trained[0].parent / "dump", dump, ignore=shutil.ignore_patterns("hf", "logs"))
    with open(dump / "metrics.jsonl", "a") as f:  # as in-loop validation and flame.eval record them
        f.write(json.dumps({"step": 4, "attempt": 1, "validation/loss": 6.5, "validation/bpb": 1.25}) + "\n")
    (dump / "eval" / "step-4").mkdir(parents=True)
    (dump / "eval" / "step-4" / "results.json").write_text(json.dumps(
        {"results": {"arc_easy": {"acc,none": 0.3125, "acc_stderr,none": 0.01, "acc_norm,none": 0.25}}}))
    assert export.main(["--path", str(dump)]) == 0
    card = (dump / "hf" / "README.md").read_text()
    for line in ("| validation loss | 6.5000 (step 4) |", "| validation bits per byte | 1.2500 (step 4) |",
                 "| `arc_easy/acc` | 0.3125 |", "| `arc_easy/acc_norm` | 0.2500 |"):
        assert line in card, line
    assert "stderr" not in card


def test_bad_config_fails_before_any_process_starts(tmp_path, tiny_model, corpus):
    result = train_sh("--job.config_file", str(job_toml(tmp_path, tiny_model, corpus)),
                      "--training.dataset", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2
    assert "missing.jsonl" in result.stderr and "does not exist" in result.stderr
    assert not (tmp_path / "dump").exists()


def test_a_dump_folder_of_another_model_is_refused_before_anything_is_overwritten(tmp_path, tiny_model, trained):
    job, trained_result = trained  # its folder holds checkpoints of 4 steps of tiny_model
    assert trained_result.returncode == 0
    dump = job.parent / "dump"
    run_config = dump / "job_config.json"
    saved = run_config.read_text()  # the export of this folder's checkpoints reads its model config here
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps({**json.loads(Path(tiny_model).read_text()), "hidden_size": 128}))
    result = train_sh("--job.config_file", str(job), "--model.config", str(wider), "--training.steps", "6")
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"flame: error: this run would load {dump / 'checkpoint' / 'step-4'}, "
                            f"which does not fit --model.config {wider}: model.embed_tokens.weight is [4096, 64] there, "
                            "[4096, 128] here"), error
    assert "--job.dump_folder" in error
    assert run_config.read_text() == saved and not (dump / "checkpoint" / "step-6").exists()
    # the folder's own model passes the same check (resuming itself is tested in test_training.py)
    result = train_sh("--job.config_file", str(job), "--training.steps", "6", env_extra={"FLAME_DRY_RUN": "1"})
    assert result.returncode == 0 and "flame: dry run" in result.stdout, result.stderr


def test_the_checkpoint_a_run_loads_is_the_one_torchtitan_picks(tmp_path, monkeypatch):
    from flame.checkpoint import manifest
    from flame.checkpoint.steps import check_checkpoint

    def job(*flags):
        return parse_job(monkeypatch, 1, "--job.config_file", str(ROOT / "configs" / "debug.toml"),
                         "--job.dump_folder", str(tmp_path), *flags)

    def step_folder(path, complete=True):  # a complete one: DCP's .metadata, then flame's manifest
        path.mkdir(parents=True)
        if complete:
            (path / ".metadata").touch()
            manifest.record(str(path))
        return str(path)

    seed = step_folder(tmp_path / "seed")
    assert check_checkpoint(job("--checkpoint.initial_load_path", seed)) == seed  # no checkpoint folder yet
    assert check_checkpoint(job("--checkpoint.no-enable")) is None
    for step in (2, 10):
        step_folder(tmp_path / "checkpoint" / f"step-{step}")
    step_folder(tmp_path / "checkpoint" / "step-11", complete=False)  # an interrupted save
    assert check_checkpoint(job("--checkpoint.initial_load_path", seed)) == str(tmp_path / "checkpoint" / "step-10")
    assert (tmp_path / "checkpoint" / "step-11.incomplete").is_dir()  # set aside: the run will write a new step-11
    assert check_checkpoint(job("--checkpoint.load_step", "2")) == str(tmp_path / "checkpoint" / "step-2")


def test_failed_training_exits_nonzero_and_exports_nothing(tmp_path, tiny_model, corpus):
    # lr 1e30 overflows the weights after one update: step 2 has a non-finite gradient
    result = train_sh("--job.config_file", str(job_toml(tmp_path, tiny_model, corpus)), "--optimizer.lr", "1e30",
                      "--checkpoint.interval", "1")
    assert result.returncode != 0
    assert "step 2: gradient norm is nan" in result.stdout + result.stderr
    assert (tmp_path / "dump" / "checkpoint" / "step-1" / ".metadata").is_file()
    assert not (tmp_path / "dump" / "hf").exists()
    assert (tmp_path / "dump" / "curves.png").is_file()  # a diverged run's curves are the ones to look at


def test_the_export_follows_whether_the_run_saves_checkpoints(tmp_path, tiny_model, corpus):
    from flame.launch import preflight

    toml = str(job_toml(tmp_path, tiny_model, corpus))
    saves = {name: preflight.check(["--job.config_file", toml, *flags], world_size=1).saves_checkpoints
             for name, flags in {"saves": [], "off": ["--checkpoint.no-enable"],
                                 "load_only": ["--checkpoint.load_only"]}.items()}
    # train.sh exports to HF only after a run that saved a checkpoint (load_only loads and never saves)
    assert saves == {"saves": True, "off": False, "load_only": False}


def test_help_prints_every_option():
    result = train_sh("-h")
    assert result.returncode == 0
    assert "--training.gradient-accumulation-steps" in result.stdout
    assert "--parallelism.data-parallel-shard-degree" in result.stdout


STACK_DUMPS = SCRIPTS / "stack_dumps.py"


def stack_dumps(wait: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """tests/scripts/stack_dumps.py: arranges flame's stack dumps, then waits by ``wait`` ("signal" or "sleep")."""
    return subprocess.run([sys.executable, str(STACK_DUMPS), wait], cwd=ROOT, env=flame_env() | (env_extra or {}),
                          capture_output=True, text=True, timeout=300, check=False)


def where_it_waits(call: str) -> str:
    """The stack-dump line of the probe's line that calls ``call``."""
    line = next(n for n, text in enumerate(STACK_DUMPS.read_text().splitlines(), 1) if text.strip().startswith(call))
    return f'File "{STACK_DUMPS}", line {line}'


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    # how a stuck rank shows where it waits (docs/running.md: "If a run seems stuck")
    result = stack_dumps("signal")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "still running"
    assert "Current thread" in result.stderr and where_it_waits("os.kill(") in result.stderr


def test_flame_dump_stacks_after_prints_the_stacks_once_without_a_signal():
    # train.sh turns FLAME_DUMP_STACKS_AFTER into this time: its own start + the seconds
    result, unset = two_at_a_time(partial(stack_dumps, "sleep", {"FLAME_DUMP_STACKS_AT": str(time.time() + 1)}),
                                  partial(stack_dumps, "sleep"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "still running"
    assert result.stderr.count("Timeout (") == 1 and where_it_waits("time.sleep(") in result.stderr
    assert "Timeout" not in unset.stderr  # unset: no dump


def test_a_bad_flame_dump_stacks_after_is_refused_before_anything_starts():
    result = train_sh("--training.steps", "1", env_extra={"FLAME_DUMP_STACKS_AFTER": "2m"})
    assert result.returncode == 2
    assert result.stderr.strip() == "flame: error: FLAME_DUMP_STACKS_AFTER must be a whole number of seconds, not '2m'"


def test_an_error_on_one_rank_is_printed_and_the_process_group_left_for_torchrun(tmp_path, tiny_model, corpus,
                                                                                  monkeypatch, capfd):
    # The other ranks may wait for the failed one in a collective; destroying the NCCL process
    # group would then wait for them and hang the job with the error unprinted.
    import torch.distributed

    import flame.training.trainer
    from flame.train import main

    class TrainerFailingOnThisRank:
        def __init__(self, config):
            self.closed = False

        def train(self):
            raise RuntimeError("stage 0 failed")

        def close(self):
            self.closed = True

    destroyed = []
    monkeypatch.setattr(flame.training.trainer, "Trainer", TrainerFailingOnThisRank)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setenv("RANK", "3")
    assert main(["--job.config_file", str(job_toml(tmp_path, tiny_model, corpus))]) == 1
    err = capfd.readouterr().err
    # one line on the console (a rank's stderr is also the console's); the traceback in the rank's file
    traceback_file = next(tmp_path.rglob("rank3-traceback.txt"))
    assert f"flame: error: rank 3 failed: stage 0 failed (RuntimeError); its traceback is in {traceback_file}" in err
    assert "Traceback" not in err and "RuntimeError: stage 0 failed" in traceback_file.read_text()
    assert not destroyed

"""Config parsing: TOML < CLI, flame's fields and aliases, errors that say what to change."""

import math
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from flame.prepare import settled
from flame.base.errors import ConfigError
from tests.conftest import ROOT, flame_env, write_job_toml


def parse(*args: str, world_size: int = 1, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return settled(list(args))


@pytest.fixture
def job_toml(tmp_path, tiny_model):
    training = "seq_len = 128\nsteps = 7\nvarlen = true\nbatch_size = 1"
    return write_job_toml(tmp_path / "job.toml", tiny_model, training, job=f'dump_folder = "{tmp_path / "from_toml"}"')


def test_toml_values_are_read(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), monkeypatch=monkeypatch)
    assert config.training.seq_len == 128
    assert config.training.steps == 7
    assert config.training.varlen is True
    assert config.job.dump_folder.endswith("from_toml")


def test_cli_overrides_toml(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), "--training.steps", "11", monkeypatch=monkeypatch)
    assert config.training.steps == 11
    assert config.training.seq_len == 128


def test_boolean_flag_can_be_turned_off_from_cli(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), "--training.no-varlen", monkeypatch=monkeypatch)
    assert config.training.varlen is False
    config = parse("--job.config_file", str(job_toml), "--training.no_varlen", monkeypatch=monkeypatch)
    assert config.training.varlen is False


def test_context_len_defaults_to_seq_len(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), monkeypatch=monkeypatch)
    assert config.training.context_len == 128


def test_historical_spellings_set_torchtitan_fields(tiny_model, monkeypatch):
    config = parse(
        f"--model.config={tiny_model}",
        "--model.tokenizer_path=builtin:python-stdlib-bpe",
        "--training.dataset=builtin:python-stdlib",
        "--training.batch_size=3",
        "--training.num_workers=2",
        "--training.seed=7",
        "--training.compile",
        "--training.data_parallel_shard_degree=2",
        "--lr_scheduler.lr_min=0.1",
        "--training.gradient_accumulation_steps=4",
        world_size=2,
        monkeypatch=monkeypatch,
    )
    assert config.training.local_batch_size == 3
    assert config.training.dataloader.num_workers == 2
    assert config.debug.seed == 7
    assert config.compile.enable is True
    assert config.parallelism.data_parallel_shard_degree == 2
    assert config.lr_scheduler.min_lr_factor == 0.1
    assert config.training.global_batch_size == 3 * 2 * 4


def test_alias_and_field_with_different_values_is_an_error(job_toml, monkeypatch):
    with pytest.raises(ConfigError, match="same setting"):
        parse("--job.config_file", str(job_toml), "--training.batch_size=2", "--training.local_batch_size=3",
              "--training.no-varlen", monkeypatch=monkeypatch)


def test_unknown_toml_key_suggests_the_closest(tmp_path, monkeypatch):
    path = tmp_path / "typo.toml"
    path.write_text("[training]\nseq_lenn = 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'training.seq_lenn'.*did you mean 'training.seq_len'"):
        parse("--job.config_file", str(path), monkeypatch=monkeypatch)


def test_unknown_toml_section_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "typo.toml"
    path.write_text("[trainig]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainig'.*did you mean 'training'"):
        parse("--job.config_file", str(path), monkeypatch=monkeypatch)


def test_unknown_cli_key_suggests_the_closest():
    result = subprocess.run(
        [sys.executable, "-m", "flame.train", "--training.seq_lenn", "5"],
        cwd=ROOT, env=flame_env(), capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "flame: error: unknown option --training.seq_lenn; did you mean --training.seq_len? "
        "Run `bash train.sh -h` for every option"
    )


def test_help_lists_flame_and_torchtitan_options():
    result = subprocess.run(
        [sys.executable, "-m", "flame.train", "-h"], cwd=ROOT, env=flame_env(), capture_output=True, text=True
    )
    assert result.returncode == 0
    for option in ("--training.varlen", "--training.context-len", "--model.config", "--lr-scheduler.lr-min",
                   "--optimizer.lr", "--checkpoint.keep-latest-k", "--training.skip-nan-inf"):
        assert option in result.stdout, option


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.batch_size=2"], "varlen packs one row per device"),
        (["--training.no-varlen", "--training.context_len=256"], "context_len 256 must be between 1 and --training.seq_len 128"),
        (["--training.dataset=a,b", "--training.data_probs=0.5"], "data_probs has 1 entries for 2 datasets"),
        (["--training.dataset=a,b", "--training.data_probs=0.5,-1"], "must all be finite numbers >= 0"),
        (["--training.dataset=a,b", "--training.data_probs=0,0"], "with a positive sum"),
        (["--training.dataset=a,b,c", "--training.dataset_split=x,y"], "dataset_split has 2 entries for 3 datasets"),
        (["--checkpoint.keep_latest_k=1"], "keep_latest_k 1"),
        (["--model.flavor=big"], "model.flavor is a torchtitan option flame does not use"),
        (["--checkpoint.initial_load_in_hf"], "initial_load_in_hf is a torchtitan option .*convert_hf_to_dcp"),
        (["--model.config=/no/such/config.json"], "does not exist"),
        (["--job.custom_config_module=other"], "set by flame"),
    ],
)
def test_inconsistent_settings_fail_with_the_fix(job_toml, monkeypatch, args, message):
    with pytest.raises(ConfigError, match=message):
        parse("--job.config_file", str(job_toml), *args, monkeypatch=monkeypatch)


@pytest.mark.parametrize(("flag", "world_size", "message"), [
    ("--parallelism.data_parallel_shard_degree=2", 4, "multiply to 2 .* but there are 4 processes"),
    ("--parallelism.data_parallel_replicate_degree=2", 3, "data_parallel_replicate_degree 2 does not divide the 3 processes"),
    ("--parallelism.expert_parallel_degree=4", 2, "expert_parallel_degree 4 does not divide the 2 data-parallel shard"),
    ("--parallelism.expert_tensor_parallel_degree=2", 2, "expert_tensor_parallel_degree 2: flame does not split"),
])
def test_impossible_parallel_layouts_are_refused(job_toml, monkeypatch, flag, world_size, message):
    with pytest.raises(ConfigError, match=message):
        parse("--job.config_file", str(job_toml), flag, world_size=world_size, monkeypatch=monkeypatch)


def test_a_replicated_layout_is_taken(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), "--parallelism.data_parallel_replicate_degree=2",
                   world_size=4, monkeypatch=monkeypatch)
    assert config.training.global_batch_size == 4  # HSDP 2 x 2, one row per rank


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_gpu_only_options_are_refused_on_cpu(job_toml, monkeypatch):
    with pytest.raises(ConfigError, match="enable_profiling needs a GPU"):
        parse("--job.config_file", str(job_toml), "--profiling.enable_profiling", monkeypatch=monkeypatch)


def test_missing_config_file_is_an_error(monkeypatch):
    with pytest.raises(ConfigError, match="--job.config_file /no/such.toml does not exist"):
        parse("--job.config_file", "/no/such.toml", monkeypatch=monkeypatch)


def test_shipped_config_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    """configs/ ships inside the package (flame/configs; the checkout's configs/ links there)."""
    monkeypatch.chdir(tmp_path)
    config = parse("--job.config_file", "configs/debug.toml", monkeypatch=monkeypatch)
    assert config.model.config == str(ROOT / "flame" / "configs" / "llama_4M.json")
    assert Path(config.model.config).samefile(ROOT / "configs" / "llama_4M.json")


def test_default_pretraining_config_parses(monkeypatch):
    config = parse("--job.config_file", "configs/flame.toml", world_size=8, monkeypatch=monkeypatch)
    assert config.training.varlen and config.training.context_len == 4096
    assert "fineweb-edu" in config.training.dataset
    assert config.compile.enable and "model" in config.compile.components  # its llama trains faster compiled


def documented_lr(step: int, *, lr: float, steps: int, warmup: int, decay_steps: int, floor: float, shape: str) -> float:
    """The LR of step ``step`` (1-based) as docs/configuration.md states it: a linear warmup over ``warmup`` steps,
    ``lr`` until the last ``decay_steps`` steps, then the decay ``shape`` towards ``lr * floor``."""
    if step <= warmup:
        return lr * step / warmup
    decay_start = steps - decay_steps + 1  # the last step at the full LR
    if step <= decay_start:
        return lr
    progress = (step - decay_start) / decay_steps
    remaining = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
                 "cosine": (1 + math.cos(math.pi * progress)) / 2}[shape]
    return lr * (floor + (1 - floor) * remaining)


def lr_per_step(config) -> list[float]:
    """The LR of every step of this config's run, from the scheduler flame's Trainer builds."""
    from torchtitan.protocols.train_spec import get_train_spec

    from flame.training.trainer import register_flame_train_spec

    register_flame_train_spec()
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.optimizer.lr)
    schedulers = get_train_spec("flame").build_lr_schedulers_fn([optimizer], config.lr_scheduler, config.training.steps)
    lrs = []
    for _ in range(config.training.steps):
        lrs.append(schedulers.schedulers[0].get_last_lr()[0])  # what the step trains with (and logs)
        optimizer.step()
        schedulers.step()
    return lrs


@pytest.mark.parametrize("shape", ["linear", "sqrt", "cosine"])
def test_wsd_schedule_warms_up_holds_then_decays_the_last_fraction_of_steps(job_toml, monkeypatch, shape):
    config = parse("--job.config_file", str(job_toml), "--training.steps=100", "--optimizer.lr=1e-3",
                   "--lr_scheduler.warmup_steps=10", "--lr_scheduler.decay_ratio=0.2", f"--lr_scheduler.decay_type={shape}",
                   "--lr_scheduler.lr_min=0.1", monkeypatch=monkeypatch)
    lrs = lr_per_step(config)
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # steps 1 and 10
    assert lrs[10:81] == pytest.approx([1e-3] * 71)  # steps 11..81 hold the peak
    for step in (82, 86, 91, 96, 100):
        expected = documented_lr(step, lr=1e-3, steps=100, warmup=10, decay_steps=20, floor=0.1, shape=shape)
        assert lrs[step - 1] == pytest.approx(expected), step
    assert 1e-4 < lrs[-1] < 1.5e-4  # the last step is one step short of the floor lr * lr_min


def test_without_decay_ratio_the_decay_starts_right_after_warmup(job_toml, monkeypatch):
    config = parse("--job.config_file", str(job_toml), "--training.steps=100", "--optimizer.lr=1e-3",
                   "--lr_scheduler.warmup_steps=10", "--lr_scheduler.decay_type=cosine", "--lr_scheduler.lr_min=0.1",
                   monkeypatch=monkeypatch)
    lrs = lr_per_step(config)
    assert lrs[10] == pytest.approx(1e-3) and lrs[11] < 1e-3  # step 11 is the peak, step 12 decays
    for step in (12, 56, 100):
        expected = documented_lr(step, lr=1e-3, steps=100, warmup=10, decay_steps=90, floor=0.1, shape="cosine")
        assert lrs[step - 1] == pytest.approx(expected), step

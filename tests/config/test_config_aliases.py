"""The command lines and TOML files of earlier flame versions: older spellings are mapped onto the
torchtitan field they mean, or refused with the spelling to use; fla.toml is the real-job config."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flame.base import device

from flame.launch import preflight
from flame.config.spellings import ALIASES, REFUSED_SPELLINGS
from flame.base.errors import ConfigError
from tests.conftest import ROOT, TOKENIZER, flame_env, parse_job, write_job_toml

# flame's README command for a 340M transformer on FineWeb-Edu, verbatim
SEED_COMMAND = """
--job.config_file configs/fla.toml
--job.dump_folder exp/transformer-340M-4K-10B/batch1.seqlen65536.context4096.warmup1024.update1.steps20480.lr1e-3.cosine
--model.config configs/transformer_340M.json --model.tokenizer_path fla-hub/transformer-1.3B-100B
--optimizer.name AdamW --optimizer.eps 1e-15 --optimizer.lr 1e-3
--lr_scheduler.warmup_steps 1024 --lr_scheduler.lr_min 0.1 --lr_scheduler.decay_type cosine
--training.batch_size 1 --training.seq_len 65536 --training.context_len 4096 --training.varlen
--training.gradient_accumulation_steps 1 --training.steps 20480 --training.max_norm 1.0 --training.skip_nan_inf
--training.dataset HuggingFaceFW/fineweb-edu --training.dataset_name sample-10BT --training.dataset_split train
--training.num_workers 32 --training.prefetch_factor 2 --training.seed 42 --training.compile
--checkpoint.interval 2048 --checkpoint.load_step -1 --checkpoint.keep_latest_k 2 --metrics.log_freq 1
""".split()


def replaced(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2:]]


@pytest.fixture
def job_toml(tmp_path, tiny_model):
    return write_job_toml(tmp_path / "job.toml", tiny_model, "seq_len = 128\nsteps = 100")


def parse(job_toml, monkeypatch, *args: str, world_size: int = 1, toml: str = ""):
    if toml:
        job_toml.write_text(job_toml.read_text() + toml)
    return parse_job(monkeypatch, world_size, "--job.config_file", str(job_toml), *args)


def test_fla_toml_is_the_real_job_config_under_its_older_name():
    configs = ROOT / "configs"
    assert (configs / "fla.toml").is_symlink() and os.readlink(configs / "fla.toml") == "flame.toml"


def test_the_seed_command_line_parses_as_written(monkeypatch):
    config = parse_job(monkeypatch, 8, *SEED_COMMAND)
    assert config.lr_scheduler.warmup_steps == 1024 and config.lr_scheduler.min_lr_factor == 0.1
    assert config.lr_scheduler.decay_type == "cosine" and config.compile.enable and config.debug.seed == 42
    assert config.training.dataloader.num_workers == 32 and config.training.dataloader.prefetch_factor == 2
    assert config.training.global_batch_size == 8 and config.training.context_len == 4096
    assert Path(config.model.config).samefile(ROOT / "configs" / "transformer_340M.json")


def test_the_seed_command_line_passes_preflight_with_local_data(tmp_path, monkeypatch, corpus):
    # the same command with the dataset and tokenizer replaced by local ones (a folder holding a
    # 'sample-10BT' configuration), checked as on a GPU machine: fla's transformer needs one
    data = tmp_path / "fineweb-edu"
    (data / "data").mkdir(parents=True)
    (data / "data" / "train.jsonl").write_text(Path(corpus).read_text())
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: data/train.jsonl\n---\n"
    )
    args = replaced(replaced(SEED_COMMAND, "--training.dataset", str(data)), "--model.tokenizer_path", TOKENIZER)
    monkeypatch.setattr(device, "CUDA", True)
    monkeypatch.chdir(tmp_path)
    assert preflight.check(args, world_size=8).saves_checkpoints


@pytest.mark.parametrize(
    "args, field, value",
    [
        (["--optimizer.scheduler", "sqrt"], "lr_scheduler.decay_type", "sqrt"),
        (["--optimizer.min_lr_ratio", "0.2"], "lr_scheduler.min_lr_factor", 0.2),
        (["--optimizer.no-fused"], "optimizer.implementation", "foreach"),
        (["--optimizer.fused"], "optimizer.implementation", "fused"),
        (["--training.warmup_steps", "5"], "lr_scheduler.warmup_steps", 5),
        (["--training.deterministic"], "debug.deterministic", True),
        (["--training.disable_loss_parallel"], "parallelism.disable_loss_parallel", True),
        (["--checkpoint.enable_checkpoint"], "checkpoint.enable", True),
        (["--checkpoint.model_weights_only"], "checkpoint.last_save_model_only", True),
        (["--metrics.no-rank_0_only"], "metrics.save_for_all_ranks", True),
        (["--metrics.rank_0_only"], "metrics.save_for_all_ranks", False),
        (["--experimental.context_parallel_degree", "2"], "parallelism.context_parallel_degree", 2),
        (["--experimental.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree", 2),
        (["--experimental.pipeline_parallel_schedule", "GPipe"], "parallelism.pipeline_parallel_schedule", "GPipe"),
        (["--experimental.pipeline_parallel_split_points", "layers.1,model.layers.3"],
         "parallelism.pipeline_parallel_split_points", "1,3"),
    ],
)
def test_an_older_spelling_on_the_command_line_sets_the_field_it_stands_for(job_toml, monkeypatch, args, field, value):
    degree = 2 if "degree" in args[0] else 1
    config = parse(job_toml, monkeypatch, *args, world_size=degree)
    section, name = field.split(".")
    assert getattr(getattr(config, section), name) == value


def test_older_spellings_in_a_toml_file_set_the_fields_they_stand_for(job_toml, monkeypatch):
    config = parse(job_toml, monkeypatch, world_size=2, toml="""
warmup_steps = 7
deterministic = true
[optimizer]
scheduler = "cosine"
min_lr_ratio = 0.3
fused = false
[checkpoint]
enable_checkpoint = true
model_weights_only = true
[metrics]
rank_0_only = false
[experimental]
pipeline_parallel_degree = 2
pipeline_parallel_split_points = ["layers.1"]
""")
    assert config.lr_scheduler.warmup_steps == 7 and config.debug.deterministic
    assert config.lr_scheduler.decay_type == "cosine" and config.lr_scheduler.min_lr_factor == 0.3
    assert config.optimizer.implementation == "foreach"
    assert config.checkpoint.enable and config.checkpoint.last_save_model_only
    assert config.metrics.save_for_all_ranks
    assert config.parallelism.pipeline_parallel_degree == 2
    assert config.parallelism.pipeline_parallel_split_points == "1"


@pytest.mark.parametrize(
    "args, toml",
    [
        (["--training.warmup_steps", "5", "--lr_scheduler.warmup_steps", "6"], ""),  # both on the command line
        ([], "\nwarmup_steps = 5\n[lr_scheduler]\nwarmup_steps = 6\n"),  # both in the TOML file
        (["--lr_scheduler.lr_min", "0.1", "--optimizer.min_lr_ratio", "0.2"], ""),  # two aliases of one field
        (["--training.no-compile", "--compile.enable"], ""),
    ],
)
def test_two_spellings_of_one_setting_that_disagree_are_an_error(job_toml, monkeypatch, args, toml):
    with pytest.raises(ConfigError, match="are the same setting; give only one"):
        parse(job_toml, monkeypatch, *args, toml=toml)


def test_either_spelling_on_the_command_line_overrides_the_other_in_the_toml_file(job_toml, monkeypatch):
    config = parse(job_toml, monkeypatch, "--lr_scheduler.warmup_steps", "6", toml="warmup_steps = 5\n")
    assert config.lr_scheduler.warmup_steps == 6
    config = parse(job_toml, monkeypatch, "--training.warmup_steps", "8")
    assert config.lr_scheduler.warmup_steps == 8
    job_toml.write_text(job_toml.read_text() + "[compile]\nenable = true\n")
    assert parse(job_toml, monkeypatch, "--training.no-compile").compile.enable is False


def test_the_real_job_config_takes_the_new_spelling_of_its_aliases(monkeypatch):
    # flame.toml spells batch_size and num_workers the older way; the torchtitan spelling overrides them
    config = parse_job(monkeypatch, 8, "--job.config_file", "configs/flame.toml",
                       "--training.dataloader.num_workers", "4")
    assert config.training.dataloader.num_workers == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--experimental.pipeline_parallel_microbatches", "4"],
         "--experimental.pipeline_parallel_microbatches is no longer a flame option: use "
         "--parallelism.pipeline_parallel_microbatch_size"),
        (["--experimental.pipeline_parallel_schedule_csv", "s.csv"], "from --parallelism.pipeline_parallel_schedule"),
        (["--experimental.pipeline_parallel_split_mode", "tracer"], "--parallelism.pipeline_parallel_split_points"),
        (["--optimizer.scheduler", "wsd"], "--lr_scheduler.decay_ratio"),
        (["--experimental.pipeline_parallel_split_points", "embeddings"],
         "names no decoder block.*--parallelism.pipeline_parallel_split_points 4,8"),
    ],
)
def test_a_spelling_whose_meaning_is_gone_is_refused_with_the_one_to_use(job_toml, monkeypatch, args, message):
    with pytest.raises(ConfigError, match=message):
        parse(job_toml, monkeypatch, *args)


def test_a_refused_spelling_in_a_toml_file_is_refused_too(job_toml, monkeypatch):
    with pytest.raises(ConfigError, match="pipeline_parallel_microbatch_size"):
        parse(job_toml, monkeypatch, toml="[experimental]\npipeline_parallel_microbatches = 4\n")


@pytest.mark.parametrize("flag", ["--memory_estimation.enabled", "--memory_estimation.enable"])
def test_memory_estimation_is_refused(job_toml, monkeypatch, flag):
    with pytest.raises(ConfigError, match="flame.s memory plan .--memory.plan auto"):
        parse(job_toml, monkeypatch, flag)


@pytest.mark.parametrize("args", [["--validation.dataset_path", "v.jsonl"], ["--quantize.linear.float8.emulate"],
                                  ["--fault_tolerance.replica_id", "1"], ["--debug.moe_force_load_balance"],
                                  ["--parallelism.pipeline_parallel_schedule_csv", "s.csv"]])
def test_a_torchtitan_field_flame_ignores_is_refused(job_toml, monkeypatch, args):
    with pytest.raises(ConfigError, match=f"{args[0]} is a torchtitan option flame does not use"):
        parse(job_toml, monkeypatch, *args)


def test_help_says_what_each_older_spelling_stands_for():
    result = subprocess.run([sys.executable, "-m", "flame.train", "-h"], cwd=ROOT, env=flame_env() | {"COLUMNS": "100"},
                            capture_output=True, text=True)
    assert result.returncode == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stdout).split())  # the panels' text, unwrapped

    def help_of(name: str) -> str:
        flag = "--" + name.replace("_", "-")
        metavar = r"(?:\{\S*\}\S* |[A-Z][A-Z,.]* )?"  # {None}|INT, STR, A,B,C,...
        match = re.search(rf"{re.escape(flag)}(?:, --\S+)? {metavar}(.*?)\(default", text)
        assert match, flag
        return match.group(1)

    for alias, target in ALIASES.items():
        assert f"Alias of {target}" in help_of(alias), alias
    for name in REFUSED_SPELLINGS:
        assert help_of(name).startswith("Refused:"), name

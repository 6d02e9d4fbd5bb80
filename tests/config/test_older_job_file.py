"""Job files of earlier flame versions: their keys that today's JobConfig has no field for are read onto
today's field, accepted (and logged once) where their value changes nothing, or refused in one line
naming what to do instead (flame.config.spellings.OLDER_KEYS)."""

import logging
import re
from pathlib import Path

import pytest
from torchtitan.config import JobConfig

from flame.base.errors import ConfigError
from flame.config import job as flame_config
from flame.config.manager import parse
from flame.config.merge import dotted_fields, merge_configs
from flame.config.spellings import OLDER_KEYS
from tests.conftest import TOKENIZER, check, losses, torchrun

# fla-org/flame's flame/models/fla.toml (2025), every key and value as it was
OLDER_FLA_TOML = """
[model]
config = "fla-hub/transformer-1.3B-100B"
tokenizer_path = "fla-hub/transformer-1.3B-100B"

[job]
dump_folder = "exp"
print_args = true

[training]
batch_size = 32
seq_len = 2048
context_len = 2048
gradient_accumulation_steps = 1
steps = 20480
max_norm = 1.0
skip_nan_inf = true
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
compile = false
dataset = "HuggingFaceFW/fineweb-edu"
dataset_name = "default"
num_workers = 32
pin_memory = false
persistent_workers = false
prefetch_factor = 2
seed = 42
varlen = false

[optimizer]
name = "AdamW"
eps = 1e-15
lr = 3e-4

[lr_scheduler]
warmup_steps = 1024
decay_type = "cosine"
lr_min = 0.1

[checkpoint]
enable_checkpoint = true
folder = "checkpoint"
interval_type = "steps"
interval = 2048
model_weights_only = false
export_dtype = "float32"
async_mode = "disabled"    # ["disabled", "async", "async_with_pinned_mem"]

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 512

[metrics]
log_freq = 32
enable_wandb = true

[experimental]
context_parallel_degree = 1
pipeline_parallel_degree = 1

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false

[activation_checkpoint]
mode = "none"
"""


def readme_flags(model: str, dump: Path) -> list[str]:
    """That flame's README command, scaled to a tiny model on the builtin corpus: the model, tokenizer and
    dataset are local, the sizes small, and the profiler and wandb (a GPU, the network) off; the rest as written."""
    return f"""
    --job.dump_folder {dump}
    --model.config {model} --model.tokenizer_path {TOKENIZER}
    --optimizer.name AdamW --optimizer.eps 1e-15 --optimizer.lr 1e-3
    --lr_scheduler.warmup_steps 2 --lr_scheduler.lr_min 0.1 --lr_scheduler.decay_type cosine
    --training.batch_size 1 --training.seq_len 256 --training.context_len 64 --training.varlen
    --training.gradient_accumulation_steps 1 --training.steps 3 --training.max_norm 1.0 --training.skip_nan_inf
    --training.dataset builtin:python-stdlib --training.dataset_split train
    --training.num_workers 1 --training.prefetch_factor 2 --training.seed 42
    --checkpoint.interval 2048 --checkpoint.load_step -1 --checkpoint.keep_latest_k 2 --metrics.log_freq 1
    --profiling.no-enable_profiling --metrics.no-enable_wandb
    """.split()


@pytest.fixture
def older_toml(tmp_path) -> Path:
    path = tmp_path / "fla.toml"
    path.write_text(OLDER_FLA_TOML)
    return path


def parsed(toml: Path, *args: str):
    return parse(["--job.config_file", str(toml), *args])


def test_the_older_fla_toml_with_the_older_readme_flags_trains_a_tiny_model(older_toml, tiny_model, tmp_path):
    dump = tmp_path / "run"
    result = check(torchrun(["--job.config_file", str(older_toml), *readme_flags(tiny_model, dump)]))
    assert sorted(losses(dump)) == [1, 2, 3]
    assert (dump / "checkpoint" / "step-3").is_dir()  # checkpoint.enable_checkpoint = true
    assert "Running with configs" in result.stdout  # job.print_args = true, read as job.print_config
    notes = [line for line in result.stdout.splitlines() if "older keys" in line]
    assert len(notes) == 2, notes  # one line of keys read as today's, one of keys that change nothing
    assert "job.print_args as job.print_config" in notes[0] and 'checkpoint.interval_type = "steps"' in notes[1]


def test_the_older_keys_are_read_onto_todays_fields(older_toml):
    job = parsed(older_toml)
    config = job.config
    assert config.job.print_config is True
    assert config.checkpoint.enable is True and config.checkpoint.last_save_model_only is False
    assert config.training.dataloader.num_workers == 32 and config.training.dataloader.persistent_workers is False
    assert config.parallelism.data_parallel_shard_degree == -1
    assert job.given["job.print_config"] and "job.print_args" not in job.given


def test_older_keys_flame_has_the_feature_of_set_it(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[job]\nprint_args = true\n"
        "[training]\npin_memory = true\npersistent_workers = true\nfsdp_reshard_after_forward = \"always\"\n"
        "[checkpoint]\nlast_save_model_weights_only = true\ninitial_load_model_weights_only = false\n"
        "[experimental]\nenable_async_tensor_parallel = true\ncontext_parallel_rotate_method = \"alltoall\"\n"
    )
    config = parsed(toml).config
    assert config.job.print_config is True
    assert config.training.dataloader.pin_memory is True and config.training.dataloader.persistent_workers is True
    assert config.parallelism.fsdp_reshard_after_forward == "always"
    assert config.checkpoint.last_save_model_only is True and config.checkpoint.initial_load_model_only is False
    assert config.parallelism.enable_async_tensor_parallel is True
    assert config.parallelism.context_parallel_rotate_method == "alltoall"


def test_the_command_line_overrides_an_older_key_of_the_job_file(older_toml):
    assert parsed(older_toml, "--job.no-print_config").config.job.print_config is False


def test_an_older_key_and_todays_key_disagreeing_are_refused(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[job]\nprint_args = true\nprint_config = false\n")
    with pytest.raises(ConfigError, match=r"'job.print_args' \(true\) and 'job.print_config' \(false\) .*give only"):
        parsed(toml)
    toml.write_text("[job]\nprint_args = true\nprint_config = true\n")
    assert parsed(toml).config.job.print_config is True


def test_older_keys_that_change_nothing_are_accepted_and_logged_once(older_toml, caplog):
    caplog.set_level(logging.INFO)
    parsed(older_toml)
    lines = [record.getMessage() for record in caplog.records if "change nothing" in record.getMessage()]
    assert len(lines) == 1
    assert lines[0].count('checkpoint.interval_type = "steps"') == 1, lines[0]
    # the [float8] keys are flame's own FP8 settings today: read as given, acting only once FP8 is on
    fp8 = parsed(older_toml).config.float8
    assert (fp8.recipe_name, fp8.enable_fsdp_float8_all_gather, fp8.precompute_float8_dynamic_scale_for_fsdp) == (
        "off", False, False)


@pytest.mark.parametrize(
    ("toml", "replacement"),
    [
        ('[checkpoint]\ninterval_type = "seconds"\n', "--checkpoint.interval counts steps"),
        ("[float8]\nemulate = true\n", "flame emulates the FP8 matmuls on CPUs by itself"),
        ('[float8]\nscaling_type_weight = "delayed"\n', "flame scales dynamically"),
        ("[experimental]\nenable_compiled_autograd = true\n", "--compile.enable"),
        ('[experimental]\ncustom_model_path = "my_models/x"\n', "under custom_models/"),
        ('[activation_offload]\nmode = "full"\n', "--activation_checkpoint.mode full"),
        ("[training]\ndebug_moe_force_load_balance = true\n", "leave it out"),
    ],
)
def test_an_older_key_whose_value_flame_cannot_honour_is_refused_naming_the_replacement(tmp_path, toml, replacement):
    path = tmp_path / "job.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as refused:
        parsed(path)
    message = str(refused.value)
    key = toml.split("\n")[0].strip("[]") + "." + toml.split("\n")[1].split(" =")[0]
    assert "\n" not in message and message.startswith(f"'{key} = ") and re.search(replacement, message), message


def test_older_options_on_the_command_line(older_toml):
    config = parsed(older_toml, "--checkpoint.no-initial_load_model_weights_only", "--training.pin_memory").config
    assert config.checkpoint.initial_load_model_only is False and config.training.dataloader.pin_memory is True
    assert parsed(older_toml, "--float8.enable_float8_linear").config.float8.recipe_name == "tensorwise"
    with pytest.raises(ConfigError, match=r"^--float8.emulate is no longer a flame option: flame emulates"):
        parsed(older_toml, "--float8.emulate")
    with pytest.raises(ConfigError, match=r"^--model.norm_type is no longer a flame option: .*--model.config"):
        parsed(older_toml, "--model.norm_type", "rmsnorm")


MERGED_FIELDS = set(dotted_fields(merge_configs(JobConfig, flame_config.JobConfig)))


def test_every_older_key_is_no_field_and_every_replacement_it_names_is_one():
    for name, older in OLDER_KEYS.items():
        assert name not in MERGED_FIELDS, name  # a field parses by itself: its entry here would never apply
        assert not older.becomes or older.becomes in MERGED_FIELDS, (name, older.becomes)
        assert older.becomes or older.fix, name  # every refusal says what to do
        for flag in re.findall(r"--([a-z_]+\.[a-z_.]+[a-z_])", older.fix):
            assert flag in MERGED_FIELDS, (name, flag)

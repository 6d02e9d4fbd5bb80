"""Data-parallel layouts on CPU: DDP, FSDP and HSDP train the same curve; checkpoints move between layouts.

The loader deals its logical data shards round-robin to the data-parallel ranks and builds
each batch from one row of each of its shards in turn, so 1 rank x 4 rows, 2 ranks x 2 rows
(or 2 micro-batches of 1) and 4 ranks x 1 row read the same 4 rows at every step: the same
global batch, hence (flame divides the loss by the global token count) the same loss and
gradient norm.
"""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flame.base import device

from flame.launch import preflight
from flame.distributed import degrees
from flame.base.errors import ConfigError
from flame.checkpoint import export
from flame.checkpoint.export import load_hf_model_from_dcp
from tests.conftest import (
    assert_same_curve,
    base_args,
    check,
    metrics,
    parse_job,
    torchrun,
    two_at_a_time,
)

DDP2 = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1"]
# name: (processes, flags); every layout reads 4 rows of 64 tokens per step
LAYOUTS = {
    "single": (1, ["--training.batch_size=4"]),
    "fsdp_one_rank": (1, ["--training.batch_size=4", "--parallelism.fsdp_one_rank"]),  # FSDP's mixed precision alone
    "ddp2": (2, ["--training.batch_size=2", *DDP2]),
    # DDP reduces the accumulated gradient at every micro-batch: it must still count each one once
    "ddp2_accumulated": (2, ["--training.batch_size=1", "--training.gradient_accumulation_steps=2", *DDP2]),
    "fsdp2": (2, ["--training.batch_size=2"]),
    "hsdp2x2": (4, ["--training.batch_size=1", "--parallelism.data_parallel_replicate_degree=2"]),
    "fsdp4": (4, ["--training.batch_size=1"]),
}
RESUME_LAYOUTS = {
    "single": (1, ["--training.batch_size=4"]),
    "fsdp2_tp2": (4, ["--training.batch_size=2", "--parallelism.data_parallel_shard_degree=2",
                      "--parallelism.tensor_parallel_degree=2"]),
    "ddp2": (2, ["--training.batch_size=2", *DDP2]),
}
TOKENS_PER_STEP = 4 * 64


def _train(model, data, dump: Path, steps: int, nproc: int, flags: list[str]) -> str:
    # one LR schedule of 6 steps for the 4-step runs and the resumptions that extend them to 6
    args = base_args(model, data, dump, steps=steps) + ["--optimizer.lr=1e-2", "--lr_scheduler.total_steps=6", *flags]
    result = check(torchrun(args, nproc=nproc))
    return result.stdout + result.stderr


def _train_all(layouts: dict, root: Path, steps: int, model, data, extra: list[str]) -> dict[str, tuple[Path, str]]:
    outputs = two_at_a_time(*(partial(_train, model, data, root / name, steps, nproc, flags + extra)
                              for name, (nproc, flags) in layouts.items()))
    return {name: (root / name, output) for name, output in zip(layouts, outputs)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, corpus) -> dict[str, tuple[Path, str]]:
    """4 steps under each layout, checkpointed at step 4: name -> (dump folder, console output)."""
    return _train_all(LAYOUTS, tmp_path_factory.mktemp("layouts"), 4, tiny_model, corpus, [])


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory, tiny_model, corpus) -> dict[str, tuple[Path, str]]:
    """The FSDP-4 checkpoint of step 4, resumed (model, optimizer, schedule, data) to step 6 under other layouts."""
    source = runs["fsdp4"][0] / "checkpoint" / "step-4"
    load = [f"--checkpoint.initial_load_path={source}", "--checkpoint.no-initial_load_model_only"]
    return _train_all(RESUME_LAYOUTS, tmp_path_factory.mktemp("resumed"), 6, tiny_model, corpus, load)


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    # Adam turns last-bit differences of near-zero gradients (another summation order) into up to
    # ~1% of a step (lr 1e-2); weights loaded wrong or not at all differ by whole steps (and init is std 0.02)
    assert got.keys() == expected.keys() and len(got) > 10
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=3e-4, msg=name)


def checkpoint_weights(dump: Path, step: int, model_config: str) -> dict[str, torch.Tensor]:
    """The HF weights of a DCP checkpoint, read as convert_dcp_to_hf reads them."""
    from flame.models import load_model_config

    return load_hf_model_from_dcp(str(dump / "checkpoint" / f"step-{step}"), load_model_config(model_config)).state_dict()


def test_every_data_parallel_layout_trains_the_single_process_curve(runs):
    # the gradient norm too: DDP or FSDP averaging instead of summing would halve it (Adam would hide it in the loss)
    expected = metrics(runs["single"][0])
    for name, (dump, _) in runs.items():
        got = metrics(dump)
        assert sorted(got) == [1, 2, 3, 4], name
        assert_same_curve(got, expected, steps=range(1, 5))
        assert got[4]["n_tokens_seen"] == 4 * TOKENS_PER_STEP, name
    assert "Applied DDP over 2 ranks" in runs["ddp2"][1]
    assert "Applied FSDP2" not in runs["ddp2"][1]
    assert "Applied FSDP2 over 2 ranks (fsdp 2)" in runs["fsdp2"][1]
    assert "Applied FSDP2 over 1 ranks (fsdp 1)" in runs["fsdp_one_rank"][1]
    assert "Applied FSDP2 over 4 ranks (dp_replicate 2 x fsdp 2)" in runs["hsdp2x2"][1]


def test_layouts_checkpoint_the_same_weights(runs, tiny_model):
    expected = checkpoint_weights(runs["single"][0], 4, tiny_model)
    for name in ("ddp2", "fsdp4", "hsdp2x2"):
        assert_same_weights(checkpoint_weights(runs[name][0], 4, tiny_model), expected)


def test_a_checkpoint_resumes_under_other_layouts(runs, resumed):
    trained = metrics(runs["fsdp4"][0])
    expected = metrics(resumed["single"][0])
    for name, (dump, output) in resumed.items():
        assert "Training starts at step 5" in output, name
        got = metrics(dump)
        assert sorted(got) == [5, 6], name
        # the step counter, token count and schedule carry on; the data stream continues elastically
        assert got[6]["n_tokens_seen"] == 6 * TOKENS_PER_STEP, name
        assert got[5]["lr"] == expected[5]["lr"] < trained[4]["lr"], name
        assert "resuming 64 data shards saved by 4 ranks x 1 workers" in output, name
        # the same batch on the same loaded weights (a layout that loaded other weights, or fresh
        # ones, would differ), then the same update (optimizer state) on every layout
        assert_same_curve(got, expected, steps=(5, 6))
    assert expected[5]["loss_metrics/global_avg_loss"] < trained[1]["loss_metrics/global_avg_loss"] - 0.1


def test_resumed_layouts_save_the_same_weights_and_any_exports_to_hf(resumed, tiny_model):
    expected = checkpoint_weights(resumed["single"][0], 6, tiny_model)
    assert_same_weights(checkpoint_weights(resumed["ddp2"][0], 6, tiny_model), expected)
    dump = resumed["fsdp2_tp2"][0]  # DTensors sharded over 2 x 2 ranks
    # in this process, as checkpoint_weights reads them: the export needs no process group
    assert export.main(["--path", str(dump)]) == 0
    assert json.loads((dump / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    exported = {}
    for shard in (dump / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert_same_weights(exported, expected)


# --- layouts refused before any process starts -------------------------------------------------

def preflight_error(tmp_path, capsys, monkeypatch, model: str, world_size: int, *flags: str) -> str:
    args = [f"--model.config={model}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", "--training.seq_len=64", *flags]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))  # launch sets it; restored after the test
    assert preflight.main(["--world-size", str(world_size), "--", *args]) == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "world_size, flags, message",
    [
        (4, ["--parallelism.data_parallel_shard_degree=2"],
         "parallel degrees multiply to 2 (data_parallel_shard=2, no other parallelism) but there are 4 processes"),
        (4, ["--parallelism.data_parallel_shard_degree=3"],
         "--parallelism.data_parallel_shard_degree 3 does not divide the 4 processes"),
        (6, ["--parallelism.tensor_parallel_degree=4"], "--parallelism.tensor_parallel_degree 4 does not divide the 6 processes"),
        (4, ["--parallelism.tensor_parallel_degree=4", "--parallelism.pipeline_parallel_degree=2"],
         "world size 4 is not divisible by tensor_parallel=4 x pipeline_parallel=2 (8)"),
        (4, [*DDP2, "--parallelism.tensor_parallel_degree=2"],
         ("DDP (--parallelism.data_parallel_replicate_degree 2 with data_parallel_shard_degree 1) does not combine with "
          "--parallelism.tensor_parallel_degree 2")),
        (4, [*DDP2, "--parallelism.pipeline_parallel_degree=2"], "does not combine with --parallelism.pipeline_parallel_degree 2"),
        (2, [*DDP2[:1], "--parallelism.fsdp_reshard_after_forward=never"],
         "--parallelism.fsdp_reshard_after_forward never applies to FSDP, but this is DDP"),
        (4, ["--parallelism.pipeline_parallel_degree=4"], "2 decoder blocks"),
        (2, ["--checkpoint.create_seed_checkpoint"], "writes unsharded initial weights from one process, but this job has 2"),
        (1, ["--checkpoint.create_seed_checkpoint", "--checkpoint.no-enable"], "saves a checkpoint: drop --checkpoint.no-enable"),
    ],
)
def test_impossible_layouts_are_one_line_errors_naming_the_fix(tmp_path, capsys, monkeypatch, tiny_model,
                                                               world_size, flags, message):
    error = preflight_error(tmp_path, capsys, monkeypatch, tiny_model, world_size, *flags)
    assert error.startswith("flame: error: ") and "\n" not in error
    assert message in error


def test_a_seed_checkpoint_starts_other_layouts_from_the_single_process_weights(tmp_path, tiny_model, corpus,
                                                                                  single_process_run):
    seed = tmp_path / "seed"
    result = check(torchrun([*base_args(tiny_model, corpus, seed, steps=4), "--checkpoint.create_seed_checkpoint"]))
    assert "Created the seed checkpoint" in result.stdout + result.stderr
    assert (seed / "checkpoint" / "step-0" / "manifest.json").is_file() and not (seed / "checkpoint" / "step-4").exists()
    assert not (seed / "metrics.jsonl").exists() or not metrics(seed), "a seed run takes no training step"
    # FSDP 2 from the seed trains the single process's curve (its 2 rows a step, one per rank): the
    # seed holds the single process's initial weights
    fsdp = tmp_path / "fsdp2"
    result = check(torchrun([*base_args(tiny_model, corpus, fsdp, steps=4), "--training.batch_size=1",
                             f"--checkpoint.initial_load_path={seed / 'checkpoint' / 'step-0'}"], nproc=2))
    assert "Loading the checkpoint from" in result.stdout + result.stderr
    assert_same_curve(metrics(fsdp), metrics(single_process_run))


def test_cpu_offload_needs_fsdp_or_one_process(job_args, monkeypatch):
    monkeypatch.setattr(device, "CUDA", True)  # the GPU-side check (on CPU, offload is refused outright)
    with pytest.raises(ConfigError, match="enable_cpu_offload offloads FSDP-sharded weights .or one process's., but this is DDP over 2"):
        parse_job(monkeypatch, 2, *job_args, "--training.enable_cpu_offload", "--parallelism.data_parallel_replicate_degree=2")
    parse_job(monkeypatch, 2, *job_args, "--training.enable_cpu_offload")
    alone = parse_job(monkeypatch, 1, *job_args, "--training.enable_cpu_offload")  # FSDP over this one process
    assert degrees.fsdp_enabled(alone, 1) and not degrees.fsdp_enabled(
        parse_job(monkeypatch, 1, *job_args), 1)
    assert degrees.fsdp_enabled(parse_job(monkeypatch, 1, *job_args, "--parallelism.fsdp_one_rank"), 1)
    with pytest.raises(ConfigError, match="^--parallelism.fsdp_one_rank wraps one process in FSDP, but this is DDP over 2"):
        parse_job(monkeypatch, 2, *job_args, "--parallelism.fsdp_one_rank", "--parallelism.data_parallel_replicate_degree=2")


def test_shard_degree_minus_one_takes_the_remaining_processes(job_args, monkeypatch):
    config = parse_job(monkeypatch, 8, *job_args, "--parallelism.tensor_parallel_degree=2", "--training.batch_size=3")
    assert config.training.global_batch_size == 3 * 4  # 8 / tp 2 = 4 data-parallel ranks
    config = parse_job(monkeypatch, 8, *job_args, "--parallelism.data_parallel_replicate_degree=8", "--training.batch_size=3")
    assert config.training.global_batch_size == 3 * 8  # DDP: the shard degree resolves to 1


@pytest.fixture
def job_args(tiny_model) -> list[str]:
    return [f"--model.config={tiny_model}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", "--training.seq_len=64"]


# --- FSDP options act ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy, resharded", [("default", True), ("always", True), ("never", False)])
def test_fsdp_reshard_after_forward_reaches_every_block(policy, resharded, two_rank_mesh, tiny_model):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from flame.distributed.parallelize import apply_fsdp
    from flame.models import load_model_config
    from flame.models.registry import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_config(tiny_model))
    job = SimpleNamespace(
        training=SimpleNamespace(mixed_precision_param="bfloat16", mixed_precision_reduce="float32", enable_cpu_offload=False),
        parallelism=SimpleNamespace(fsdp_reshard_after_forward=policy, pipeline_parallel_degree=1),
    )
    layers = decoder_layers(model)
    apply_fsdp(model, layers, two_rank_mesh, job)
    for module in [*layers, model.get_input_embeddings()]:
        group = module._get_fsdp_state()._fsdp_param_group  # torch keeps the policy there, with no getter
        assert (group.post_forward_mesh_info is not None) == resharded
        assert group.mp_policy.param_dtype == device.compute_dtype(job) and group.mp_policy.reduce_dtype == torch.float32


@pytest.fixture
def two_rank_mesh():
    """A 2-rank FSDP mesh in this process (fake collectives): enough to shard a meta model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    dist.destroy_process_group()


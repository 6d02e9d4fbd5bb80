"""Tensor parallelism (with sequence parallelism) on CPU: plans, parity with unsharded runs, refusals.

fla's linear-attention kernels are Triton (GPU) code: for gla, gsa, delta_net and
gated_deltanet only the plans are checked here (every parameter placed, every sharded size
divisible); `python scripts/gpu_check.py --suite tp` runs them on GPUs. FSDP 2 x TP 2 is checked in
tests/distributed/test_layouts.py: resumed from an FSDP 4 checkpoint, it trains the single process's steps.
"""

import json
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from flame.launch import preflight
from flame.distributed.tensor_parallel import (
    PLANS,
    apply_tensor_parallel,
    check_tensor_parallel,
    plan_for,
)
from flame.base.errors import ConfigError
from flame.models.support import RECORDS, model_types_where
from flame.checkpoint import export
from tests.conftest import ROOT, SCRIPTS, assert_same_curve, base_args, check, metrics, torchrun, two_at_a_time

TP2 = ["--parallelism.tensor_parallel_degree=2"]
EXAMPLE = str(ROOT / "custom_models" / "example_lm" / "config_tiny.json")
WITH_PLANS = model_types_where(lambda support: support.tensor_parallel_plan)
TINY = {name: str(ROOT / "configs" / "tiny" / f"{name}.json") for name in WITH_PLANS if name != "flame_example_lm"}
TINY["flame_example_lm"] = EXAMPLE


@pytest.fixture(scope="module")
def two_rank_mesh():
    """A 2-rank TP mesh in this process (fake collectives): enough to shard meta models."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def test_every_plan_is_named_by_a_record_and_has_a_tiny_config():
    assert {RECORDS[name].tensor_parallel_plan for name in WITH_PLANS} == set(PLANS)
    assert set(TINY) == set(WITH_PLANS)
    for model_type, path in TINY.items():
        assert json.loads(Path(path).read_text())["model_type"] == model_type, path


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_shards_every_parameter_of_the_tiny_model(model_type, two_rank_mesh):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from flame.models import load_model_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_model_config(TINY[model_type]))
    shapes = {name: param.shape for name, param in model.named_parameters()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    job = SimpleNamespace(parallelism=SimpleNamespace(disable_loss_parallel=False, enable_async_tensor_parallel=False))
    apply_tensor_parallel(model, two_rank_mesh, job)
    params = dict(model.named_parameters())
    assert params.keys() == shapes.keys()
    for name, param in params.items():
        assert isinstance(param, DTensor) and param.shape == shapes[name], name  # the full shape, sharded
    plan = plan_for(model_type)
    for path, local in plan.block.items():  # every sub-layer splits its heads or features
        prefix = f"{plan.layers}.0.{path}."
        placements = [param.placements[0] for name, param in params.items() if name.startswith(prefix)]
        assert any(p.is_shard() for p in placements) == local.sharded, (path, placements)
    for head_or_embedding in (model.get_output_embeddings(), model.get_input_embeddings()):
        assert head_or_embedding.weight.placements[0].is_shard(0)  # vocabulary rows
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


def test_sharded_gradients_equal_unsharded_gradients(tmp_path):
    """One packed batch: loss and every gradient, TP 2 against the same weights unsharded (both loss paths)."""
    specs = ["qwen3", "mistral:fused", "qwen2", "transformer:fused", "mamba2", "mamba2:fused", "gla"]
    paths = [f"{TINY[name.split(':')[0]]}{':fused' if name.endswith(':fused') else ''}" for name in specs]
    # the tiny gla has 2 heads, one per rank; the 340M has 4, so each rank holds two and splits q/k/v/gates by head
    gla_two_heads_per_rank = tmp_path / "gla_4_heads.json"
    gla_two_heads_per_rank.write_text(json.dumps({**json.loads(Path(TINY["gla"]).read_text()), "num_heads": 4}))
    paths.append(str(gla_two_heads_per_rank))
    result = check(torchrun(paths, nproc=2, module=str(SCRIPTS / "tp_grad_parity.py")))
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("parity ")]
    assert [row[1] for row in rows] == paths
    for _, spec, loss_error, grad_error in rows:
        assert float(loss_error) < 1e-5 and float(grad_error) < 1e-4, (spec, loss_error, grad_error)


def test_tensor_parallel_run_matches_one_process(tmp_path, tiny_model, corpus, single_process_run):
    single, fused, compiled = single_process_run, tmp_path / "tp_fused", tmp_path / "tp_compiled"
    result, compiled_result = two_at_a_time(
        partial(torchrun, base_args(tiny_model, corpus, fused, steps=4) + TP2 + ["--training.fused_cross_entropy=on"],
                nproc=2),
        # logits + CE under loss_parallel, with the blocks compiled and checkpointed
        partial(torchrun, base_args(tiny_model, corpus, compiled, steps=4) + TP2 + [
            "--training.fused_cross_entropy=off", "--training.compile", "--compile.backend=aot_eager",
            "--activation_checkpoint.mode=full"], nproc=2),
    )
    check(result)
    check(compiled_result)
    assert "Applied tensor parallelism over 2 ranks with sequence parallelism to 2 blocks" in result.stdout + result.stderr
    assert_same_curve(metrics(fused), metrics(single))
    assert_same_curve(metrics(compiled), metrics(single))


def test_tensor_parallel_checkpoint_exports_the_single_process_weights(tmp_path, corpus):
    """The custom example (tied embeddings, fused loss): DCP saved by 2 TP ranks -> HF = the 1-process export."""
    single, sharded = tmp_path / "single", tmp_path / "tp"
    for result in two_at_a_time(
        partial(torchrun, base_args(EXAMPLE, corpus, single, steps=4)),
        partial(torchrun, base_args(EXAMPLE, corpus, sharded, steps=4) + TP2 + ["--training.fused_cross_entropy=on"],
                nproc=2),
    ):
        check(result)
    assert_same_curve(metrics(sharded), metrics(single))
    exported = []
    for run in (single, sharded):
        # in this process: the export needs no process group, and a fresh one would import torch again
        assert export.main(["--path", str(run)]) == 0
        weights = {}
        for shard in (run / "hf").glob("*.safetensors"):
            weights.update(load_file(shard))
        exported.append(weights)
    expected, got = exported
    assert got.keys() == expected.keys() and len(got) > 10
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def preflight_error(tmp_path, capsys, monkeypatch, model_config: dict, *flags: str) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model_config))
    args = [f"--model.config={path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", "--training.seq_len=64", *TP2, *flags]
    monkeypatch.setenv("WORLD_SIZE", "2")  # launch sets it; restored after the test
    assert preflight.main(["--world-size", "2", "--", *args]) == 2
    return capsys.readouterr().err.strip()


def test_layouts_tensor_parallelism_cannot_run_are_refused_before_training(tmp_path, capsys, monkeypatch):
    llama = json.loads(Path(TINY["llama"]).read_text())
    error = preflight_error(tmp_path, capsys, monkeypatch, json.loads((ROOT / "configs/tiny/rwkv7.json").read_text()))
    assert "no tensor-parallel plan for model_type 'rwkv7'" in error and "flame/distributed/tensor_parallel.py" in error
    assert "llama" in error and "mamba2" in error  # the types that have one
    error = preflight_error(tmp_path, capsys, monkeypatch, {**llama, "num_key_value_heads": 1})
    assert "--parallelism.tensor_parallel_degree 2 does not divide llama's num_key_value_heads (1)" in error
    error = preflight_error(tmp_path, capsys, monkeypatch, {**llama, "intermediate_size": 705})
    assert "cannot shard this llama: model.layers.0.mlp.intermediate_size = 705" in error
    error = preflight_error(tmp_path, capsys, monkeypatch, llama, "--training.seq_len=63")
    assert "--training.seq_len 63 is not divisible by --parallelism.tensor_parallel_degree 2" in error


def test_async_tensor_parallel_needs_tensor_parallelism_and_compile():
    from types import SimpleNamespace

    from flame.models import load_model_config

    config = load_model_config(TINY["llama"])

    def job(tp: int, compile: bool):
        return SimpleNamespace(
            parallelism=SimpleNamespace(tensor_parallel_degree=tp, enable_async_tensor_parallel=True),
            compile=SimpleNamespace(enable=compile, components=["model", "loss"]), training=SimpleNamespace(seq_len=64),
        )

    with pytest.raises(ConfigError, match="needs --parallelism.tensor_parallel_degree > 1"):
        check_tensor_parallel(config, job(1, True))
    with pytest.raises(ConfigError, match="add --training.compile"):
        check_tensor_parallel(config, job(2, False))
    check_tensor_parallel(config, job(2, True))
    # gla's blocks stay eager under --training.compile: there is no compiled block to overlap in
    with pytest.raises(ConfigError, match=r"and fla's gla's stay eager under --training.compile \(.*\); leave it off$"):
        check_tensor_parallel(load_model_config(TINY["gla"]), job(2, True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_async_tensor_parallel_is_refused_on_cpu(tmp_path, capsys, monkeypatch):
    llama = json.loads(Path(TINY["llama"]).read_text())
    error = preflight_error(tmp_path, capsys, monkeypatch, llama, "--parallelism.enable_async_tensor_parallel",
                            "--training.compile")
    assert error == (
        "flame: error: --parallelism.enable_async_tensor_parallel needs CUDA (inductor's symmetric-memory kernels); "
        "leave it off on CPU"
    )

"""Mixture-of-experts models of transformers (flame.models.moe): flame's loss, the router's load-balancing loss
included, equals transformers' own on the same weights; the experts run as one grouped GEMM; FLOPs count the active
experts; the load metrics; FSDP on 2 ranks trains the curve of 1 rank, the load in the log."""

import types

import pytest
import torch
import transformers.integrations.moe as grouped_experts
from transformers import AutoModelForCausalLM

from flame.base.errors import ConfigError
from flame.models import load_model_config, moe
from flame.models.builder import FlameModelArgs, build_model
from flame.models.flops import model_flops
from flame.models.inputs import model_inputs
from flame.models.loss import build_loss
from flame.distributed.pipeline import check_pipeline_parallel
from tests.conftest import assert_same_curve, check, metrics, train_job

MOE_TYPES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]


def _flame_model(model_type: str):
    path = f"configs/tiny/{model_type}.json"
    args = FlameModelArgs(config_path=path)
    args._config = load_model_config(path)
    torch.manual_seed(0)
    return build_model(args).train(), path


def _loss_fn(path: str):
    job = types.SimpleNamespace(training=types.SimpleNamespace(z_loss=0.0, logit_softcap=0.0),
                                compile=types.SimpleNamespace(enable=False, components=[]),
                                model=types.SimpleNamespace(config=path))
    return build_loss(job)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_the_loss_with_the_router_term_is_transformers_own(model_type):
    model, path = _flame_model(model_type)
    assert model.config._experts_implementation == "grouped_mm"  # one grouped GEMM, not the loop over experts
    reference = AutoModelForCausalLM.from_config(load_model_config(path)).train()
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (2, 33))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    batch = {"input": inputs, "cu_seqlens": torch.tensor([0, 32, 64], dtype=torch.int32), "max_seqlen": 32,
             "position_ids": torch.arange(32).repeat(2, 1)}
    model_ids, model_labels, kwargs = model_inputs(model, batch, labels)
    assert kwargs["output_router_logits"]
    ours = _loss_fn(path)(model(model_ids, **kwargs), model_labels) / labels.numel()
    theirs = reference(inputs, labels=inputs, shift_labels=labels.contiguous(), output_router_logits=True)
    assert theirs.aux_loss > 0 and reference.router_aux_loss_coef > 0
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)  # mean CE + coefficient x aux
    counts, aux_sum = moe.take_router_load()
    assert counts.shape == (2, moe.expert_count(model.config))
    assert counts.sum(dim=1).tolist() == [64 * model.config.num_experts_per_tok] * 2  # every token's top_k choices
    torch.testing.assert_close(aux_sum, theirs.aux_loss.detach() * labels.numel())


def test_validation_gets_no_router_term():
    model, path = _flame_model("qwen3_moe")
    model.eval()
    batch = {"input": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 8], dtype=torch.int32),
             "max_seqlen": 8, "position_ids": torch.arange(8)[None]}
    _, _, kwargs = model_inputs(model, batch, torch.zeros(1, 8, dtype=torch.long))
    assert "output_router_logits" not in kwargs


def test_flops_count_the_active_experts_and_the_routers():
    model, _ = _flame_model("qwen3_moe")
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = config.num_hidden_layers * 3 * config.moe_intermediate_size * config.hidden_size  # one expert's weights
    routers = config.num_hidden_layers * config.num_experts * config.hidden_size
    assert model_flops(model).matmul_flops == 6 * (linear + experts * config.num_experts_per_tok + routers)


def test_load_metrics_by_hand():
    counts = torch.tensor([[10.0, 10.0, 10.0, 10.0], [40.0, 0.0, 0.0, 0.0]])
    found = moe.load_metrics(counts)
    assert found["moe/layer0/load_max"] == found["moe/layer0/load_min"] == 1.0
    assert found["moe/layer0/load_entropy"] == pytest.approx(1.0)
    assert (found["moe/layer1/load_max"], found["moe/layer1/load_min"]) == (4.0, 0.0)
    assert found["moe/layer1/load_entropy"] == pytest.approx(0.0, abs=1e-6)
    assert (found["moe/load_max"], found["moe/load_min"], found["moe/load_entropy"]) == (4.0, 0.0, pytest.approx(0.5))


def test_pipeline_parallelism_is_refused_for_a_mixture_of_experts():
    job = types.SimpleNamespace(parallelism=types.SimpleNamespace(pipeline_parallel_degree=2))
    with pytest.raises(ConfigError, match="is a mixture of experts, whose load-balancing loss sums the routers"):
        check_pipeline_parallel(load_model_config("configs/tiny/qwen3_moe.json"), job)


# 4 rows a step either way: one micro-batch of 4 rows, or 2 rows on each of 2 ranks, balanced together
MOE_RUN = ("--model.config=configs/tiny/qwen3_moe.json", "--training.global_batch_size=4", "--checkpoint.interval=4")


@pytest.mark.background_runs(one=train_job(4, *MOE_RUN, "--training.batch_size=4"),
                             two=train_job(4, *MOE_RUN, "--training.batch_size=2", nproc=2))
def test_fsdp_on_two_ranks_trains_the_curve_of_one_with_the_load_in_the_log(background_runs):
    one, two = background_runs["one"], background_runs["two"]
    check(one.result)
    check(two.result)
    assert "experts x" in two.result.stdout + two.result.stderr
    expected, got = metrics(one.dump), metrics(two.dump)
    assert_same_curve(got, expected, rel=1e-4)
    for step in expected:
        assert got[step]["loss_metrics/router_aux_loss"] == pytest.approx(expected[step]["loss_metrics/router_aux_loss"],
                                                                         rel=1e-4)
        assert got[step]["moe/layer1/load_max"] == expected[step]["moe/layer1/load_max"]  # the same routing
        assert 1 <= got[step]["moe/load_max"] <= 8 and 0 <= got[step]["moe/load_min"] <= 1


def test_under_autocast_the_experts_multiply_in_its_dtype_and_their_float32_weights_get_gradients():
    _flame_model("qwen3_moe")  # building a MoE model applies flame.compat.transformers.experts_in_the_autocast_dtype
    weights = torch.randn(4, 8, 16, requires_grad=True)
    tokens, offsets = torch.randn(10, 8), torch.tensor([3, 5, 8, 10], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_experts._grouped_mm(tokens, weights, offsets)  # what the experts' forward calls
    assert out.dtype == torch.bfloat16  # upstream: a float32 product (transformers' loop over experts on CUDA)
    out.float().sum().backward()
    assert weights.grad is not None and weights.grad.dtype == torch.float32
    torch.testing.assert_close(out.float(), grouped_experts._grouped_mm(tokens, weights, offsets), rtol=2e-2, atol=2e-2)

"""Mixture-of-experts models of transformers (flame.models.moe, flame.models.experts): flame's loss, the router's
load-balancing loss included, equals transformers' own on the same weights; flame's experts forward gives
transformers' outputs and gradients; FLOPs count the active experts; the load metrics; FSDP on 2 ranks trains the
curve of 1 rank and so does expert parallelism over 2, whose checkpoint resumes without it."""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from flame.base.errors import ConfigError
from flame.checkpoint.export import load_hf_model_from_dcp
from flame.models import experts, load_model_config, moe
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
    assert model.config._experts_implementation == experts.IMPLEMENTATION
    reference = AutoModelForCausalLM.from_config(load_model_config(path)).train()
    reference.config._experts_implementation = "eager"  # transformers' loop over the experts
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (2, 33))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    batch = {"input": inputs, "cu_seqlens": torch.tensor([0, 32, 64], dtype=torch.int32), "max_seqlen": 32,
             "position_ids": torch.arange(32).repeat(2, 1)}
    model_ids, model_labels, kwargs = model_inputs(model, batch, labels)
    assert "output_router_logits" not in kwargs  # flame listens to the routers: transformers computes no loss of its own
    ours = _loss_fn(path)(model(model_ids, **kwargs), model_labels) / labels.numel()
    theirs = reference(inputs, labels=inputs, shift_labels=labels.contiguous(), output_router_logits=True)
    assert theirs.aux_loss > 0 and reference.router_aux_loss_coef > 0
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)  # mean CE + coefficient x aux
    ours.backward()
    theirs.loss.backward()
    for router, reference_router in zip(moe.routers(model), moe.routers(reference)):  # the term's gradient reaches them
        torch.testing.assert_close(router.weight.grad, reference_router.weight.grad, rtol=1e-4, atol=1e-7)
    counts, aux_sum = moe.take_router_load()
    assert counts.shape == (2, moe.expert_count(model.config))
    assert counts.sum(dim=1).tolist() == [64 * model.config.num_experts_per_tok] * 2  # every token's top_k choices
    torch.testing.assert_close(aux_sum, theirs.aux_loss.detach() * labels.numel())


def test_validation_gets_no_router_term():
    model, path = _flame_model("qwen3_moe")
    model.eval()
    batch = {"input": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 8], dtype=torch.int32),
             "max_seqlen": 8, "position_ids": torch.arange(8)[None]}
    ids, labels, kwargs = model_inputs(model, batch, torch.zeros(1, 8, dtype=torch.long))
    loss = _loss_fn(path)
    with torch.no_grad():
        plain = loss(model(ids, **kwargs), labels)
    assert moe.take_router_load() == (None, None) and not moe.tap.choices
    model.train()
    assert loss(model(ids, **kwargs), labels) > plain  # training adds the term, with the load


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_flames_experts_give_transformers_outputs_and_gradients(model_type):
    model, path = _flame_model(model_type)
    reference = AutoModelForCausalLM.from_config(load_model_config(path))
    reference.load_state_dict(model.state_dict())
    reference.config._experts_implementation = "eager"
    ids = torch.randint(0, 4096, (2, 24))
    for each in (model, reference):
        each(ids).logits.square().mean().backward()
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_trace_the_experts_routing_without_a_graph_break():
    """torch.compile traces a MoE block's routing (sort, per-expert ends, gathers) in one graph: no operator whose
    output size depends on the data (torch.bincount's would split the graph and make the host wait). The only breaks
    left are the CPU stand-in's loop over the experts, which reads their row counts (a GPU runs one grouped GEMM)."""
    model, _ = _flame_model("qwen3_moe")
    layer = model.model.layers[0]
    hidden = model.model.embed_tokens(torch.randint(0, 4096, (1, 32)))
    positions = torch.arange(32)[None]
    explained = torch._dynamo.explain(layer)(hidden, position_embeddings=model.model.rotary_emb(hidden, positions),
                                            position_ids=positions)
    where = {frame.name for reason in explained.break_reasons for frame in reason.user_stack[-1:]}
    assert explained.graph_break_count and where == {"_spans"}, where


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
MOE_RUN = ("--model.config=configs/tiny/qwen3_moe.json", "--training.global_batch_size=4", "--checkpoint.interval=2")
EP2 = "--parallelism.expert_parallel_degree=2"


@pytest.mark.background_runs(one=train_job(4, *MOE_RUN, "--training.batch_size=4"),
                             ep=train_job(4, *MOE_RUN, "--training.batch_size=2", EP2, nproc=2))
def test_experts_over_two_ranks_train_the_curve_of_one_and_resume_under_another_expert_parallel_degree(
        background_runs, tiny_model, corpus):
    one, ep = background_runs["one"], background_runs["ep"]
    check(one.result)
    check(ep.result)
    printed = ep.result.stdout + ep.result.stderr
    assert "Applied expert parallelism over 2 ranks to 2 MoE layers (4 of 8 experts a rank)" in printed
    assert "experts x" in printed  # the load in the log
    expected, got = metrics(one.dump), metrics(ep.dump)
    assert_same_curve(got, expected, rel=1e-4)
    for step in expected:
        assert got[step]["loss_metrics/router_aux_loss"] == pytest.approx(expected[step]["loss_metrics/router_aux_loss"],
                                                                         rel=1e-4)
        assert got[step]["moe/layer1/load_max"] == expected[step]["moe/layer1/load_max"]  # the same routing
        assert 1 <= got[step]["moe/load_max"] <= 8 and 0 <= got[step]["moe/load_min"] <= 1
    # its step 2 resumed on 2 ranks that each hold every expert (FSDP alone): the curve goes on
    resumed = ep.dump.parent / "resumed-without-ep"
    check(train_job(4, *MOE_RUN, "--training.batch_size=2", f"--checkpoint.initial_load_path={ep.dump / 'checkpoint' / 'step-2'}",
                    "--checkpoint.no-initial_load_model_only", nproc=2)(resumed, tiny_model, corpus))
    assert_same_curve(metrics(resumed), expected, rel=1e-4, steps=[3, 4])
    # the checkpoint holds every expert whole: its HF model is the one-rank run's
    config = load_model_config("configs/tiny/qwen3_moe.json")
    ids = torch.randint(0, 4096, (1, 16))
    logits = [load_hf_model_from_dcp(str(run / "checkpoint" / "step-4"), config, runnable=True)(ids).logits
              for run in (one.dump, ep.dump)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)


def test_the_selection_bias_moves_toward_an_even_load_by_hand():
    model, _ = _flame_model("glm4_moe")
    balance = moe.SelectionBias(model, rate=0.01)
    balance.update(torch.tensor([[10.0, 0, 5, 5, 5, 5, 5, 5], [40.0, 0, 0, 0, 0, 0, 0, 0]]))
    first, second = balance.biases
    assert first.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])
    assert second.tolist() == pytest.approx([-0.01] + [0.01] * 7)


def test_a_selection_bias_is_refused_for_routers_without_one():
    model, _ = _flame_model("qwen3_moe")
    with pytest.raises(ConfigError, match="qwen3_moe routes without a selection bias .* glm4_moe"):
        moe.check_selection_bias(model, 1e-3)


BIAS_RUN = ("--model.config=configs/tiny/glm4_moe.json", "--training.global_batch_size=4", "--checkpoint.interval=3",
            "--training.router_bias_rate=0.01")


@pytest.mark.background_runs(one=train_job(3, *BIAS_RUN, "--training.batch_size=4"),
                             two=train_job(3, *BIAS_RUN, "--training.batch_size=2", nproc=2))
def test_selection_biases_balance_over_every_rank_and_are_kept_by_the_checkpoint(background_runs):
    one, two = background_runs["one"], background_runs["two"]
    check(one.result)
    check(two.result)
    assert_same_curve(metrics(two.dump), metrics(one.dump), rel=1e-4)
    config = load_model_config("configs/tiny/glm4_moe.json")
    biases = [{name: tensor for name, tensor in load_hf_model_from_dcp(str(run / "checkpoint" / "step-3"), config)
               .state_dict().items() if name.endswith(moe.SELECTION_BIAS)} for run in (one.dump, two.dump)]
    assert len(biases[0]) == 2 and biases[0].keys() == biases[1].keys()  # the two MoE layers (the first is dense)
    for name, bias in biases[0].items():
        assert torch.equal(bias, biases[1][name])  # the load of both ranks' tokens, as one rank's of them all
        steps = bias / 0.01  # three updates of one rate each
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 3 and bias.abs().sum() > 0


def test_under_autocast_the_experts_multiply_in_its_dtype_and_their_float32_weights_get_gradients():
    model, _ = _flame_model("qwen3_moe")
    layer = experts.experts_modules(model)[0]
    tokens = torch.randn(10, model.config.hidden_size)
    ids, weights = torch.randint(0, 8, (10, 2)), torch.rand(10, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(tokens, ids, weights)
    exact = layer(tokens, ids, weights)
    assert out.dtype == torch.float32 and not torch.equal(out, exact)  # computed in bf16, as autocast runs an nn.Linear
    torch.testing.assert_close(out, exact, rtol=3e-2, atol=3e-2)
    out.sum().backward()
    assert layer.gate_up_proj.grad is not None and layer.gate_up_proj.grad.dtype == torch.float32

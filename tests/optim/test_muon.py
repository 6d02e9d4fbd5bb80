"""Muon (--optimizer.name Muon): torch.optim.Muon's update on whole matrices under FSDP x TP,
AdamW on the rest, exact resume; the Nsight Systems window is a no-op on CPU.

The layout runs use lr 1e-2, where orthogonalizing each FSDP or TP shard on its own (instead
of the whole matrix) moves the gradient norm by 0.5% at step 2 and the loss by 0.2% at step 4;
whole-matrix Muon repeats the single process's curve to the rounding of its bf16 Newton-Schulz
iteration (relative 4e-4 at most here; the tolerance is 2e-3).
"""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from flame.training.nsys import NsysWindow
from flame.optim.builder import build_lr_schedulers, build_optimizers
from flame.optim.muon import Muon, newton_schulz, split_parameters
from flame.models import load_model_config
from flame.models.registry import meta_model
from tests.conftest import (
    TINY_DECODER,
    assert_same_curve,
    check,
    metrics,
    train_job,
)

MUON = ("--optimizer.name=Muon", "--optimizer.lr=1e-2", "--checkpoint.interval=2")
SINGLE = (*MUON, "--training.batch_size=4")
FSDP2_TP2 = (*MUON, "--training.batch_size=2", "--parallelism.data_parallel_shard_degree=2",
             "--parallelism.tensor_parallel_degree=2")
BF16_NEWTON_SCHULZ = 2e-3  # relative: loss and gradient norm under another layout


def test_batched_newton_schulz_is_torch_optim_muons_iteration():
    torch.manual_seed(0)
    for shape in [(24, 40), (40, 24), (32, 32)]:  # wide, tall (transposed inside), square
        stack = torch.randn(3, *shape)
        got = newton_schulz(stack, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        for matrix, ortho in zip(stack, got):
            torch.testing.assert_close(ortho, _zeropower_via_newtonschulz(matrix, (3.4445, -4.7750, 2.0315), 5, 1e-7),
                                       rtol=1e-2, atol=1e-3)  # equal on CPU; bf16 rounding elsewhere
        # nearly orthogonal rows (or columns): singular values within NS's band around 1
        singular = torch.linalg.svdvals(got.float())
        assert singular.min() > 0.5 and singular.max() < 1.5


@pytest.mark.parametrize("nesterov, rule", [(True, "match_rms_adamw"), (False, "original")])
def test_muon_steps_like_torch_optim_muon(nesterov, rule):
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 48), (32, 32), (48, 16)]  # two of one shape share a stack
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": rule}
    optimizers = Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
        assert not torch.equal(p, torch.zeros_like(p))


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("qwen2", True)])
def test_muon_takes_the_decoder_blocks_linear_weights_and_adamw_the_rest(tmp_path, model_type, tied):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **TINY_DECODER, "vocab_size": 4096,
                                "max_position_embeddings": 512, "tie_word_embeddings": tied}))
    model = meta_model(load_model_config(str(path)))
    muon, adamw = split_parameters(model)
    names = {id(p): name for name, p in model.named_parameters()}
    hidden = {f"model.layers.{i}.{block}.{projection}.weight" for i in range(2)
              for block, projections in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
              for projection in (f"{p}_proj" for p in projections)}
    assert {names[id(p)] for p in muon} == hidden
    assert {names[id(p)] for p in adamw} == set(names.values()) - hidden
    # embeddings and the head are 2-D too, but not hidden matrices; norms and qwen2's q/k/v biases are 1-D
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= {names[id(p)] for p in adamw}
    assert ("lm_head.weight" in names.values()) != tied  # tied: the embedding itself
    assert ("model.layers.1.self_attn.q_proj.bias" in names.values()) == (model_type == "qwen2")


def test_each_model_parts_schedule_keeps_its_own_lrs_when_a_checkpoint_loads():
    # pipeline stages: one with a bias (an AdamW group and a Muon group), one with matrices only
    def part(bias: bool) -> torch.nn.Module:
        module = torch.nn.Module()
        module.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8, bias=bias)])
        return module

    optimizer = SimpleNamespace(name="Muon", lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                implementation="for-loop", muon_lr=2e-2, muon_momentum=0.95, muon_weight_decay=None, param_groups="", decay_everything=False,
                                muon_nesterov=True, muon_ns_steps=5, muon_adjust_lr="match_rms_adamw", on_host=False)
    schedule = SimpleNamespace(warmup_steps=2, total_steps=None, decay_ratio=None, decay_type="linear",
                               min_lr_factor=0.0)

    def build():
        optimizers = build_optimizers([part(True), part(False)], optimizer, None)
        return optimizers, build_lr_schedulers(optimizers, schedule, 10)

    trained, schedulers = build()
    for _ in range(3):
        schedulers.step()
    resumed, loaded = build()
    loaded.load_state_dict(schedulers.state_dict())  # torchtitan saves the first part's schedule only
    loaded.step()
    schedulers.step()
    assert [[g["lr"] for g in o.param_groups] for o in resumed] == [[g["lr"] for g in o.param_groups] for o in trained]
    assert [g["lr"] for g in resumed.optimizers[1].param_groups] == [pytest.approx(2e-2 * 6 / 8)]  # Muon's lr


def test_nsys_window_is_a_no_op_on_cpu():
    window = NsysWindow(2, 4)
    assert not window.enabled  # no CUDA: no profiler calls, no NVTX ranges
    with window.step(2), window.range("forward"):
        pass
    assert not window.capturing


@pytest.mark.background_runs(single=train_job(4, *SINGLE), fsdp2_tp2=train_job(4, *FSDP2_TP2, nproc=4))
def test_muon_trains_the_same_curve_under_fsdp_and_tp_and_resumes_exactly(background_runs, tiny_model, corpus):
    single, sharded = background_runs["single"], background_runs["fsdp2_tp2"]
    check(single.result)
    check(sharded.result)
    assert "Muon on 14 hidden matrices (73,728 parameters); AdamW's parameter groups: embeddings" in single.result.stdout + single.result.stderr
    expected = metrics(single.dump)
    assert expected[4]["loss_metrics/global_avg_loss"] < expected[1]["loss_metrics/global_avg_loss"] - 0.2
    # FSDP 2 x TP 2 shards every matrix over both mesh dimensions: Muon orthogonalizes the whole of it
    assert_same_curve(metrics(sharded.dump), expected, rel=BF16_NEWTON_SCHULZ)

    # from step 2 the run repeats steps 3-4 bit for bit: momentum, AdamW's moments and both lrs resume
    # (the Nsight window's flags change nothing on CPU)
    resumed = single.dump.parent / "resumed"
    check(train_job(4, *SINGLE, f"--checkpoint.initial_load_path={single.dump / 'checkpoint' / 'step-2'}",
                    "--checkpoint.no-initial_load_model_only", "--profiling.nsys_start_step=3",
                    "--profiling.nsys_stop_step=4")(resumed, tiny_model, corpus))
    got = metrics(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in ("loss_metrics/global_avg_loss", "grad_norm", "lr"):
            assert got[step][key] == expected[step][key], (step, key)

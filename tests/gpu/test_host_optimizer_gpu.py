"""--optimizer.on_host on a GPU: the copy streams, pinned buffers and per-block waits give torch's AdamW
updates, and a run trains, checkpoints and resumes without the flag."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.components.host_optimizer import HostAdamW
from tests.conftest import (
    TINY_DECODER,
    assert_same_curve,
    base_args,
    check,
    metrics,
    torchrun,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# relative: torch's CUDA and CPU fused AdamW kernels round apart; a missed wait (a block computing with
# the weights of the step before) moves the weights by an update, some 1e-3 at this lr
KERNELS_APART = 1e-5


def test_host_steps_match_cuda_adamw_while_the_forward_overlaps_them():
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_DECODER, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8},
                         vocab_size=4096, max_position_embeddings=512)
    ours = LlamaForCausalLM(config).cuda()
    theirs = LlamaForCausalLM(config).cuda()
    theirs.load_state_dict(ours.state_dict())
    settings = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    host = HostAdamW(ours, **settings)
    plain = torch.optim.AdamW(theirs.parameters(), **settings, fused=True)
    assert host.units[0].host_params == [] and host.cuda
    for step in range(6):
        ids = torch.randint(0, 4096, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, optimizer in ((ours, host), (theirs, plain)):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()  # the host's returns at once; the next forward waits block by block
            optimizer.zero_grad()
    host.settle()
    assert all(buffer.is_pinned() for unit in host.units for buffer in unit.buffers)
    for (name, mine), expected in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(mine, expected, rtol=KERNELS_APART, atol=1e-7, msg=name)


def test_a_run_on_host_trains_and_its_checkpoint_resumes_without_it(tmp_path, tiny_model, corpus):
    host, plain = tmp_path / "host", tmp_path / "plain"
    args = ["--optimizer.lr=1e-2", "--checkpoint.interval=10"]
    check(torchrun(base_args(tiny_model, corpus, host, steps=20) + args + ["--optimizer.on_host"]))
    check(torchrun(base_args(tiny_model, corpus, plain, steps=20) + args))
    curve = metrics(host)
    assert curve[20]["loss_metrics/global_avg_loss"] < curve[1]["loss_metrics/global_avg_loss"] - 0.7
    assert_same_curve(curve, metrics(plain), rel=1e-3)  # bf16 autocast, two AdamW kernels
    resumed = tmp_path / "resumed"
    check(torchrun(base_args(tiny_model, corpus, resumed, steps=20) + args + [
        f"--checkpoint.initial_load_path={host / 'checkpoint' / 'step-10'}", "--checkpoint.no-initial_load_model_only"]))
    assert_same_curve(metrics(resumed), curve, rel=1e-3, steps=[11, 15, 20])

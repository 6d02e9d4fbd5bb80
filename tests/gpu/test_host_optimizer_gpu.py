"""--optimizer.on_host on a GPU: each unit computes with the weights of the step just taken (the copy
streams, pinned buffers and per-unit waits), and a run trains, checkpoints and resumes without the flag."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.optim.host import HostAdamW
from flame.optim.pinned import arena_bytes
from tests.conftest import (
    TINY_DECODER,
    base_args,
    check,
    losses,
    torchrun,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fingerprint(unit) -> torch.Tensor:
    return torch.stack([p.detach().double().square().sum() for p in unit.params])


@pytest.mark.parametrize("gpu_blocks", [0, 3])
def test_every_unit_computes_with_its_updated_weights_while_the_host_steps_the_next(gpu_blocks):
    """gpu_blocks 3: the embeddings and the first 3 blocks step on the GPU's stream, the rest on the host."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_DECODER, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8},
                         vocab_size=32000, max_position_embeddings=512)
    model = LlamaForCausalLM(config).cuda()
    host = HostAdamW(model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, gpu_blocks=gpu_blocks)
    seen = {}  # each unit's weights as its forward found them, read on the GPU's stream right after flame's wait
    for unit in host.units:
        def record(*_, unit=unit):
            seen[id(unit)] = fingerprint(unit)
        if unit.after:
            unit.module.register_forward_hook(record)
        else:
            unit.module.register_forward_pre_hook(record)
    previous = None
    for step in range(5):
        ids = torch.randint(0, 32000, (4, 512), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        # the forward has waited for every unit: the weights are now the previous step's result
        now = [fingerprint(unit) for unit in host.units]
        if previous is not None:
            for unit, written, old in zip(host.units, now, previous):
                torch.testing.assert_close(seen[id(unit)], written, rtol=0, atol=0)
                assert not torch.equal(written, old)  # the step did move them: the check can fail
        previous = now
        host.step()  # returns at once; the host steps while the next forward starts
        host.zero_grad()
    host.settle()
    copied = [(*unit.host_params, *unit.host_grads) for unit in host.units[host.on_device :]]
    assert host.waited > 0 and all(t.is_pinned() for tensors in copied for t in tensors)
    # pinned in the arena's chunks, as many as the memory plan counts for them (flame.optim.pinned)
    chunk = 4 * host.arena.chunk_elements
    assert len(host.arena.chunks) * chunk == arena_bytes([t.numel() for tensors in copied for t in tensors], chunk)
    on_device = {id(p) for unit in host.units[: host.on_device] for p in unit.params}
    assert len(on_device) == (0 if not gpu_blocks else 1 + 3 * len(list(model.model.layers[0].parameters())))
    for param, state in host.state.items():
        assert state["exp_avg"].device.type == ("cuda" if id(param) in on_device else "cpu")


def test_a_run_on_host_trains_the_offloaded_curve_and_its_checkpoint_resumes_without_it(tmp_path, tiny_model, corpus):
    """The reference is CPU offload, the other one-GPU layout under FSDP over its rank: bf16 weights and
    AdamW on the host's CPU both. Against the plain run (autocast, a float32 residual stream, CUDA's AdamW)
    a tiny model at lr 1e-2 drifts 5% apart within 20 steps, which would hide a real error."""
    seed = tmp_path / "seed"  # one set of initial weights: offload initializes them on the host, from its RNG
    check(torchrun([*base_args(tiny_model, corpus, seed, steps=20), "--checkpoint.create_seed_checkpoint"]))
    args = ["--optimizer.lr=1e-2", "--checkpoint.interval=10", "--lr_scheduler.total_steps=20",
            f"--checkpoint.initial_load_path={seed / 'checkpoint' / 'step-0'}"]
    host, offloaded, resumed = tmp_path / "host", tmp_path / "offload", tmp_path / "resumed"
    result = check(torchrun(base_args(tiny_model, corpus, host, steps=20) + args + ["--optimizer.on_host"]))
    assert "Applied FSDP2 over 1 ranks" in result.stdout + result.stderr  # degrees.fsdp_alone
    check(torchrun(base_args(tiny_model, corpus, offloaded, steps=20) + args + ["--training.enable_cpu_offload"]))
    curve = losses(host)
    assert curve[20] < curve[1] - 0.7
    assert curve == pytest.approx(losses(offloaded), rel=5e-3)
    # the run's checkpoint is an ordinary one: it resumes under offload, the optimizer's state on the host as well
    check(torchrun(base_args(tiny_model, corpus, resumed, steps=20) + [
        "--optimizer.lr=1e-2", "--lr_scheduler.total_steps=20", "--training.enable_cpu_offload",
        f"--checkpoint.initial_load_path={host / 'checkpoint' / 'step-10'}", "--checkpoint.no-initial_load_model_only"]))
    assert losses(resumed) == pytest.approx({step: curve[step] for step in range(11, 21)}, rel=5e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_shards_on_the_host_train_the_plain_fsdp_losses(tmp_path, tiny_model, corpus):
    """Each rank steps its own shards on the host (DTensor state); the root's weights wait at the forward's start."""
    host, plain = tmp_path / "host", tmp_path / "plain"
    args = ["--optimizer.lr=1e-2", "--checkpoint.no-enable"]
    check(torchrun(base_args(tiny_model, corpus, host, steps=20) + args + ["--optimizer.on_host"], nproc=2))
    check(torchrun(base_args(tiny_model, corpus, plain, steps=20) + args, nproc=2))
    curve = losses(host)
    assert curve[20] < curve[1] - 0.7
    assert curve == pytest.approx(losses(plain), rel=5e-3)

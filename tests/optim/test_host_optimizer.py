"""--optimizer.on_host (AdamW's state stepped on the host while the next forward runs) and
--activation_checkpoint.blocks (full AC of the first N blocks): the same updates as torch's AdamW,
AdamW's checkpoints both ways, FSDP, and what the memory plan makes of them.

On this CPU machine host and device are one memory: the runs exercise the same steps (units,
host thread, forward pre-hooks, checkpoint settling) without the copy streams.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame import memory
from flame.optim.host import HostAdamW, leading_units, units_of
from flame.distributed.parallelize import checkpoint_blocks
from flame.base.errors import ConfigError
from flame.memory.estimate import estimate, gpu_bytes
from flame.memory.layout import Layout
from flame.memory.plan import candidates, choose
from flame.memory.price import host_step, price
from flame.models import load_model_config
from flame.models.registry import decoder_layers, meta_model
from tests.conftest import (
    TINY_DECODER,
    assert_same_curve,
    base_args,
    check,
    metrics,
    parse_job,
    train_job,
)
from tests.memory.test_memory_plan import H100, job_args

SINGLE = ("--optimizer.lr=1e-2", "--checkpoint.interval=2", "--training.batch_size=4")
FSDP2 = ("--optimizer.lr=1e-2", "--checkpoint.interval=2", "--training.batch_size=2",
         "--parallelism.data_parallel_shard_degree=2")
FSDP_SUMS = 1e-5  # relative: FSDP's reduce-scatter sums the gradients in another order than one process


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER, vocab_size=256, max_position_embeddings=64))


def train(model, optimizer, steps, lrs=None):
    """``steps`` updates on fixed random batches; the lr changed after each step (as the LR schedule does)."""
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        if lrs:
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
        optimizer.zero_grad()


@pytest.mark.parametrize("decoupled, reference, gpu_blocks", [(True, torch.optim.AdamW, 0), (False, torch.optim.Adam, 0),
                                                              (True, torch.optim.AdamW, 1)])
def test_host_steps_are_torchs_fused_adamw_and_its_checkpoints_are_adamws(decoupled, reference, gpu_blocks):
    """gpu_blocks 1: the embeddings and the first block step where their weights are (the CPU here), the rest on
    the host's thread: the same fused AdamW either way."""
    settings = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours, theirs = tiny_llama(), tiny_llama()
    host = HostAdamW(ours, **settings, decoupled=decoupled, gpu_blocks=gpu_blocks)
    assert host.on_device == (2 if gpu_blocks else 0)
    plain = reference(theirs.parameters(), **settings, fused=True)
    train(ours, host, 3, lrs=[2e-3, 1e-3, 5e-4])
    train(theirs, plain, 3, lrs=[2e-3, 1e-3, 5e-4])
    host.settle()
    for mine, expected in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, expected)
    saved, expected = host.state_dict(), plain.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    for key, state in expected["state"].items():
        assert set(saved["state"][key]) == set(state)
        for name, value in state.items():
            assert torch.equal(saved["state"][key][name].cpu(), value.cpu()), (key, name)
    # AdamW's state loads into the host optimizer (kept on the host) and the two go on alike
    resumed = HostAdamW(ours, **settings, decoupled=decoupled, gpu_blocks=gpu_blocks)
    resumed.load_state_dict(plain.state_dict())
    assert all(value.device.type == "cpu" for state in resumed.state.values() for value in state.values())
    train(ours, resumed, 2)
    train(theirs, plain, 2)
    resumed.settle()
    for mine, expected in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(mine, expected)


def test_units_come_in_the_order_the_forward_needs_them():
    model = tiny_llama()
    units = units_of(model)
    # the embeddings, waited for as the forward starts; each block; the final norm and head once the last block ran
    assert units[0].module is model and units[0].params == [model.model.embed_tokens.weight] and not units[0].after
    assert [unit.module for unit in units[1:-1]] == list(model.model.layers)
    assert units[-1].module is model.model.layers[-1] and units[-1].after
    assert {id(p) for p in units[-1].params} == {id(model.model.norm.weight), id(model.lm_head.weight)}
    assert sum(len(unit.params) for unit in units) == len(list(model.parameters()))


def test_the_leading_units_are_the_ones_the_forward_computes_before_the_kth_block_ends():
    model = tiny_llama()  # 2 blocks: the embeddings, block 0, block 1, then the final norm and head
    units = units_of(model)
    assert [leading_units(units, model, blocks) for blocks in (0, 1, 2, 5)] == [0, 2, 3, 3]  # never the head


def test_a_failed_host_step_stops_the_next_forward_with_its_cause():
    model = tiny_llama()
    host = HostAdamW(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    host.param_groups[0]["lr"] = None  # the host thread's fused AdamW takes no such lr
    host.step()
    with pytest.raises(RuntimeError, match=r"--optimizer.on_host: the host's optimizer step failed \(TypeError: "):
        model(input_ids=ids)


def test_weights_stepped_in_place_let_go_of_their_gradients_for_zero_grad_to_free():
    """Under FSDP's CPU offload the host steps the offloaded weights with the offloaded gradients. Once stepped the
    optimizer must not hold those gradients: the next backward allocates its own beside any still referenced (a 7B's
    25 GiB twice on a 128 GiB host, which the out-of-memory killer ended). One rank, gloo: FSDP's shards live on the
    host as offloaded ones do."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_llama()
        mesh = init_device_mesh("cpu", (1,))
        for block in decoder_layers(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        host = HostAdamW(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        assert host.in_place
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        ids = torch.randint(0, 256, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():  # the local shards themselves, as the host step reads them
            gradients = [weakref.ref(p.grad.to_local()) for p in model.parameters()]
        host.step()
        host.settle()
        host.zero_grad()
        gc.collect()
        assert all(p.detach().full_tensor().ne(b).any() for p, b in zip(model.parameters(), before))  # stepped
        assert [ref() is None for ref in gradients] == [True] * len(gradients)
    finally:
        dist.destroy_process_group()


@pytest.mark.background_runs(
    plain=train_job(4, *SINGLE),
    host=train_job(4, *SINGLE, "--optimizer.on_host"),
    host_gpu1=train_job(4, *SINGLE, "--optimizer.on_host", "--optimizer.gpu_blocks=1"),
    fsdp2=train_job(4, *FSDP2, "--optimizer.on_host", "--activation_checkpoint.mode=full",
                    "--activation_checkpoint.blocks=1", nproc=2),
    # the layout the memory plan gives a 7B on one GPU: full AC and micro-batches (the same 4 rows a step)
    host_planned=train_job(4, *SINGLE, "--optimizer.on_host", "--activation_checkpoint.mode=full",
                           "--training.batch_size=2", "--training.gradient_accumulation_steps=2"),
)
def test_on_host_trains_adamws_curve_alone_and_under_fsdp_and_resumes_without_it(background_runs, tiny_model, corpus):
    plain, host, host_gpu1, fsdp2, planned = (background_runs[name] for name in (
        "plain", "host", "host_gpu1", "fsdp2", "host_planned"))
    for run in (plain, host, host_gpu1, fsdp2, planned):
        check(run.result)
    expected = metrics(plain.dump)
    assert expected[4]["loss_metrics/global_avg_loss"] < expected[1]["loss_metrics/global_avg_loss"] - 0.2
    # one process stepping on the host runs under FSDP over its one rank (degrees.fsdp_alone): the same numbers
    assert "Applied FSDP2 over 1 ranks" in host.result.stdout + host.result.stderr
    assert_same_curve(metrics(host.dump), expected, rel=0)  # the same fused AdamW kernel, on the same CPU
    assert_same_curve(metrics(host_gpu1.dump), expected, rel=0)  # the first block's state where its weights are
    # FSDP shards the state (DTensors on the host); the first block alone recomputed
    assert "Applied full activation checkpointing to the first 1 of 2 blocks" in fsdp2.result.stdout + fsdp2.result.stderr
    assert_same_curve(metrics(fsdp2.dump), expected, rel=FSDP_SUMS)
    assert_same_curve(metrics(planned.dump), expected, rel=FSDP_SUMS)  # two micro-batches sum in another order
    # its checkpoint is AdamW's: resumed without the flag, steps 3-4 repeat bit for bit
    resumed = host.dump.parent / "resumed"
    check(train_job(4, *SINGLE, f"--checkpoint.initial_load_path={host.dump / 'checkpoint' / 'step-2'}",
                    "--checkpoint.no-initial_load_model_only")(resumed, tiny_model, corpus))
    got = metrics(resumed)
    assert sorted(got) == [3, 4]
    assert_same_curve(got, metrics(host.dump), rel=0, steps=[3, 4])


STREAMED = ("--training.enable_cpu_offload", "--optimizer.on_host")


@pytest.mark.background_runs(
    plain=train_job(4, *SINGLE),
    streamed=train_job(4, *SINGLE, *STREAMED),
    streamed_fsdp2=train_job(4, *FSDP2, *STREAMED, nproc=2),
)
def test_weights_streamed_from_the_host_train_adamws_curve_and_resume_exactly(background_runs, tiny_model, corpus):
    """FSDP's CPU offload with the host optimizer: the host steps the offloaded weights in place, unit by unit while
    the next forward runs (on a CPU host and device are one memory: the same steps, nothing saved)."""
    plain, streamed, fsdp2 = (background_runs[name] for name in ("plain", "streamed", "streamed_fsdp2"))
    for run in (plain, streamed, fsdp2):
        check(run.result)
    expected = metrics(plain.dump)
    assert_same_curve(metrics(streamed.dump), expected, rel=0)
    assert_same_curve(metrics(fsdp2.dump), expected, rel=FSDP_SUMS)
    resumed = streamed.dump.parent / "streamed-resumed"  # its step 2, streamed again: steps 3-4 bit for bit
    check(train_job(4, *SINGLE, *STREAMED, f"--checkpoint.initial_load_path={streamed.dump / 'checkpoint' / 'step-2'}",
                    "--checkpoint.no-initial_load_model_only")(resumed, tiny_model, corpus))
    assert_same_curve(metrics(resumed), metrics(streamed.dump), rel=0, steps=[3, 4])


def test_flags_that_cannot_combine_with_them_are_refused(tiny_model, corpus, tmp_path, monkeypatch):
    args = base_args(tiny_model, corpus, tmp_path / "x")
    refused = [
        (["--optimizer.on_host", "--optimizer.name=Muon"], "--optimizer.on_host steps AdamW or Adam on the host"),
        (["--optimizer.gpu_blocks=2"], "add --optimizer.on_host, or drop gpu_blocks"),
        (["--optimizer.on_host", "--optimizer.gpu_blocks=-1"], "a count of decoder blocks, 0 or more"),
        (["--activation_checkpoint.blocks=1"], "add --activation_checkpoint.mode full"),
        (["--activation_checkpoint.mode=full", "--activation_checkpoint.blocks=0"], "must be at least 1"),
    ]
    for flags, message in refused:
        with pytest.raises(ConfigError, match=message):
            parse_job(monkeypatch, 1, *args, *flags)
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
    with pytest.raises(ConfigError, match="--activation_checkpoint.blocks 3: the model has 2 decoder blocks"):
        checkpoint_blocks(layers, SimpleNamespace(mode="full", blocks=3), model_compile_enabled=False)


def test_the_plan_steps_the_optimizer_on_the_host_where_that_fits_and_costs_least(tiny_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(tiny_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 1), can_offload=True, can_step_on_host=True, compute_bytes=2,
                              autocast_copies=True)  # one GPU in bf16
    start = memory.layout_of(config)
    on_host = Layout(host_optimizer=True)
    parts = {part.name: part for part in estimate(job, on_host)}
    assert parts["optimizer state"].where == "host (stepped there)" and parts["parameters"].where == "GPU"
    # pinned fp32 copies of the weights and gradients, in the arena's chunks (flame.optim.pinned)
    assert parts["host step buffers"].bytes == job.host_copy_pinning * 8 * job.params
    assert gpu_bytes(estimate(job, Layout())) - gpu_bytes(estimate(job, on_host)) == pytest.approx(1.1 * 8 * job.params)
    # both: the weights streamed, the offloaded weights stepped in place beside the next forward, no buffers of its own
    streamed = Layout(offload=True, host_optimizer=True)
    assert streamed in candidates(job, start, set(), None)
    parts = {part.name: part for part in estimate(job, streamed)}
    assert parts["parameters"].where == "host (CPU offload)" and "host step buffers" not in parts
    assert gpu_bytes(estimate(job, streamed)) == gpu_bytes(estimate(job, Layout(offload=True)))
    # the host's step hides behind the next forward as far as it can: less than offload's transfers, and less
    # than FSDP2's offload stepping torch's AdamW on the host between the steps
    assert 0 < price(job, on_host, H100).offload < price(job, Layout(offload=True), H100).offload
    assert price(job, streamed, H100).offload < price(job, Layout(offload=True), H100).offload
    # a budget the state's 8 bytes a parameter decide: the host step, at less than recomputing a block
    budget = gpu_bytes(estimate(job, on_host))
    plan = choose(job, start, set(), budget, None, rates=lambda: H100)
    assert plan.layout == on_host, plan.layout
    memory.set_layout(config, start, plan.layout)
    assert config.optimizer.on_host and memory.layout_of(config) == on_host
    # given, it is kept; a host budget without room for it rules it out
    assert choose(job, start, {"host_optimizer"}, budget, None, rates=lambda: H100).layout != on_host
    assert not any(layout.host_optimizer for layout in candidates(job, start, set(), 0.5 * 16 * job.params))


def test_the_plan_counts_the_state_gpu_blocks_keeps_on_the_gpu(tiny_model, monkeypatch):
    """A given --optimizer.gpu_blocks is planned around: the embeddings' and first blocks' state on the GPU,
    the rest (and its pinned buffers) on the host, the host's step priced for the rest alone."""
    jobs = [memory.job_of(parse_job(monkeypatch, 1, *job_args(tiny_model, "--memory.plan=off", "--optimizer.on_host",
                                                             f"--optimizer.gpu_blocks={k}")), 1) for k in (0, 1)]
    model = meta_model(load_model_config(tiny_model))
    # one process stepping on the host runs under FSDP over its one rank, whose root gathers everything outside
    # the blocks (embeddings, final norm, head) as the forward starts: their state joins the first block's
    outside = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in decoder_layers(model).parameters())
    first = outside + sum(p.numel() for p in decoder_layers(model)[0].parameters())
    assert all(job.fsdp for job in jobs) and [job.gpu_state_params for job in jobs] == [0, first]
    none, one = ({(p.name, p.where): p.bytes for p in estimate(job, Layout(host_optimizer=True))} for job in jobs)
    assert ("optimizer state", "GPU") not in none and one[("optimizer state", "GPU")] == 8 * first
    assert one[("optimizer state", "host (stepped there)")] == none[("optimizer state", "host (stepped there)")] - 8 * first
    assert jobs[0].host_copy_pinning == jobs[1].host_copy_pinning
    assert one[("host step buffers", "host (pinned)")] == pytest.approx(
        none[("host step buffers", "host (pinned)")] - jobs[1].host_copy_pinning * 8 * first)
    assert host_step(jobs[1], H100, hidden_by=0.0) < host_step(jobs[0], H100, hidden_by=0.0)

"""--memory.stream_weights (flame.optim.streaming): the weights on the host as float32 masters, each block's copied to
the device in the compute dtype as the forward and the backward reach it, its gradients back as the backward makes
them, AdamW stepped on the host unit by unit beside the next forward.

On this CPU machine host and device are one memory: the runs take the same steps (the units' buffers allocated and
released, the leaves swapped in and out, gradients copied down, sums and updates on the host thread) with copies in
place of transfers; over two processes, gloo's all-gathers and reduce-scatters. The GPU side (copy streams, events)
runs in tests/gpu/test_weight_streaming_gpu.py.
"""

import copy
import dataclasses

import pytest
import torch
from torchtitan.config import ActivationCheckpoint
from transformers import LlamaConfig, LlamaForCausalLM

from flame import memory
from flame.base.errors import ConfigError
from flame.distributed.parallelize import checkpoint_blocks
from flame.memory.estimate import GIB, estimate, gpu_bytes, host_bytes
from flame.memory.layout import Layout
from flame.memory.plan import candidates, choose
from flame.memory.price import price
from flame.models import lora
from flame.models.registry import decoder_layers
from flame.optim.stream_shards import _copy_chunks
from flame.optim.stream_units import Unit
from flame.optim.streamed_adamw import StreamedAdamW
from flame.optim.streaming import WeightStream
from tests.conftest import TINY_DECODER, assert_same_curve, base_args, check, metrics, parse_job, train_job, two_at_a_time
from tests.memory.test_memory_plan import H100, job_args, long_model  # noqa: F401, F811 - long_model: a fixture

SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SINGLE = ("--optimizer.lr=1e-2", "--checkpoint.interval=2", "--training.batch_size=4")
STREAMED = ("--memory.stream_weights",)


def full_ac():
    """The job's --activation_checkpoint.mode full, as the parallelize step reads it."""
    ac = ActivationCheckpoint(mode="full")
    ac.blocks = None  # flame's setting: every block
    return ac


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER, vocab_size=256, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


def steps(model, optimizer, count: int, passes: int = 1, streamed: bool = True, max_norm: float = 1.0) -> list[float]:
    """``count`` clipped updates, each over ``passes`` micro-batches of fixed random rows; the losses."""
    losses = []
    for step in range(count):
        optimizer.zero_grad()
        if streamed:
            optimizer.stream.begin_step(passes)
        total = 0.0
        for micro in range(passes):
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 * step + micro))
            loss = model(input_ids=ids, labels=ids).loss / passes
            loss.backward()
            total += loss.item()
        if streamed:
            optimizer.clip_grad_norm_(max_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("tied, passes, checkpointed", [(False, 1, False), (True, 2, True)])
def test_streamed_steps_are_torchs_fused_adamw_with_the_same_clipping(tied, passes, checkpointed):
    """The masters end where torch's fused AdamW puts the same model's weights, tied embeddings once, with full AC
    recomputing each block from its input and micro-batches summed on the host."""
    ours, theirs = tiny_llama(tied), tiny_llama(tied)
    if checkpointed:
        for model in (ours, theirs):
            checkpoint_blocks(decoder_layers(model), full_ac(), model_compile_enabled=False)
    stream = WeightStream(ours, torch.float32, torch.device("cpu"))
    streamed = StreamedAdamW(ours, stream, **SETTINGS)
    plain = torch.optim.AdamW(theirs.parameters(), **SETTINGS, fused=True)
    # a clipping bound below the first steps' norms: the scale reaches the update
    got = steps(ours, streamed, 3, passes, max_norm=0.5)
    expected = steps(theirs, plain, 3, passes, streamed=False, max_norm=0.5)
    streamed.settle()
    assert got == pytest.approx(expected, rel=1e-6)
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        assert mine.device.type == "cpu" and mine.dtype == torch.float32 and mine.grad is None
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)
    # between the passes a block's buffer is released; the resident unit's (embeddings, head) stays
    assert all(unit.storage.nbytes() == 0 for unit in stream.blocks) and stream.resident.storage.nbytes() > 0
    assert sum(len(unit.masters) for unit in stream.units) == len(list(ours.parameters()))
    saved, reference = streamed.state_dict(), plain.state_dict()
    assert saved["param_groups"] == reference["param_groups"]
    assert {key: set(state) for key, state in saved["state"].items()} == {
        key: set(state) for key, state in reference["state"].items()}


def test_a_loaded_state_continues_the_steps_exactly_and_the_gpu_takes_the_loaded_weights():
    """A run stopped after 2 steps and loaded into a fresh streamed model (weights, then AdamW's state) takes steps 3-4
    as the run that went on; the compute-dtype copies are taken again from the loaded masters."""
    model = tiny_llama()
    stream = WeightStream(model, torch.float32, torch.device("cpu"))
    optimizer = StreamedAdamW(model, stream, **SETTINGS)
    steps(model, optimizer, 2)
    optimizer.settle()  # as a checkpoint's save does: the step in flight writes the weights
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())  # a save's snapshot
    went_on = steps(model, optimizer, 2)
    fresh = tiny_llama()  # the initial weights: what the resident buffer holds until the load
    fresh_stream = WeightStream(fresh, torch.float32, torch.device("cpu"))
    fresh_optimizer = StreamedAdamW(fresh, fresh_stream, **SETTINGS)
    fresh.load_state_dict(weights)
    fresh_optimizer.load_state_dict(state)
    assert fresh_stream.stale
    assert steps(fresh, fresh_optimizer, 2) == went_on


def test_the_gpu_holds_the_compute_dtype_and_the_masters_stay_float32():
    """In bfloat16 the leaves the blocks compute with are bf16 (the masters float32, stepped in float32): the losses
    follow the float32 run's within bf16's rounding."""
    model, reference = tiny_llama(), tiny_llama()
    stream = WeightStream(model, torch.bfloat16, torch.device("cpu"))
    optimizer = StreamedAdamW(model, stream, **SETTINGS)
    seen = []
    decoder_layers(model)[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(module.up_proj.weight.dtype))
    got = steps(model, optimizer, 3)
    expected = steps(reference, torch.optim.AdamW(reference.parameters(), **SETTINGS, fused=True), 3, streamed=False)
    assert set(seen) == {torch.bfloat16} and all(p.dtype == torch.float32 for p in model.parameters())
    assert got == pytest.approx(expected, rel=2e-2)
    (_, _, flat), = stream.blocks[0].flats
    assert flat.dtype == torch.float32 and stream.blocks[0].landing.dtype == torch.bfloat16
    assert all(master.untyped_storage().data_ptr() == unit.flats[0][2].untyped_storage().data_ptr()
               for unit in stream.units for master in unit.masters)  # the masters live in their unit's buffer


def test_lora_streams_its_frozen_base_in_its_own_dtype_and_steps_only_the_adapters():
    """LoRA's frozen base, held in bf16 (lora.hold_base_in), goes up without a cast and has no landing, gradients
    or state; the float32 adapters go up cast to bf16, come down and are stepped: the losses follow the same
    adapted model computing in bf16 under autocast, and the base does not move."""
    settings = lora.LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=("all-linear",))

    def adapted() -> LlamaForCausalLM:
        model = tiny_llama()
        lora.add_adapters(model, settings)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: a step moves it, and only then the output
                torch.nn.init.normal_(param, std=0.02)
        lora.hold_base_in(model, torch.bfloat16)
        return model

    model, reference = adapted(), adapted()
    base = {name: param.clone() for name, param in model.named_parameters() if not param.requires_grad}
    stream = WeightStream(model, torch.bfloat16, torch.device("cpu"))
    optimizer = StreamedAdamW(model, stream, **SETTINGS)
    block = stream.blocks[0]
    assert [host.dtype for _, _, host in block.flats] == [torch.bfloat16, torch.float32]  # base, adapters
    adapters = sum(master.numel() for master in block.masters if master.requires_grad)
    assert block.grad_numel == adapters == block.landing.numel() < block.numel / 4
    got = steps(model, optimizer, 3)
    plain = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **SETTINGS, fused=True)
    with torch.autocast("cpu", torch.bfloat16):
        expected = steps(reference, plain, 3, streamed=False)
    optimizer.settle()
    assert got == pytest.approx(expected, rel=1e-2)
    assert all(torch.equal(param, base[name]) for name, param in model.named_parameters() if name in base)
    assert all(id(p) in stream.graded for p in model.parameters() if p.requires_grad)  # LoRA's first-step check
    assert len(optimizer.state) == sum(p.requires_grad for p in model.parameters())


def test_an_error_on_the_host_thread_stops_the_next_forward_in_one_line():
    model = tiny_llama()
    stream = WeightStream(model, torch.float32, torch.device("cpu"))
    optimizer = StreamedAdamW(model, stream, **SETTINGS)
    stream.host.put(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match=r"--memory.stream_weights: the host's work failed \(ZeroDivisionError"):
        steps(model, optimizer, 1)


def test_shards_split_dim_0_as_fsdp_and_their_chunks_rebuild_each_parameter():
    """Over 3 ranks a 5-row weight splits 2, 2, 1 and a 4-row one 2, 2, 0 (torch.chunk's split, DTensor's Shard(0)),
    each chunk padded to 2 rows: the ranks' shard layouts side by side (an all-gather's output) give every parameter
    back whole, and a full gradient packed for the reduce-scatter puts each rank's rows in its chunk."""
    weight, bias = torch.arange(15.0).view(5, 3).requires_grad_(), (torch.arange(4.0) + 100).requires_grad_()
    ranks = [Unit("block 0", [weight, bias], [[], []]) for _ in range(3)]
    for rank, unit in enumerate(ranks):
        unit.layout(3, rank)
        assert unit.local_shapes == [torch.Size([(2, 2, 1)[rank], 3]), torch.Size([(2, 2, 0)[rank]])]
        assert unit.chunks == [6, 2] and unit.shard_numel == unit.grad_numel == 8
    gathered = torch.zeros(3, 8)
    for rank, unit in enumerate(ranks):  # each rank's rows (from row 2 x rank) in its shard layout, padding zero
        for master, offset, shape in zip(unit.masters, unit.shard_offsets, unit.local_shapes):
            gathered[rank, offset : offset + shape.numel()] = master.detach()[2 * rank : 2 * rank + shape[0]].reshape(-1)
    unit = ranks[0]
    for master, offset, chunk in zip(unit.masters, unit.shard_offsets, unit.chunks):
        master = master.detach()
        rebuilt = torch.full((master.numel(),), -1.0)
        _copy_chunks(rebuilt, gathered[:, offset : offset + chunk], into_chunks=False)
        assert torch.equal(rebuilt, master.reshape(-1))
        packed = torch.full((3, chunk), -1.0)  # the padding zeroed by the packing
        _copy_chunks(master.reshape(-1), packed, into_chunks=True)
        assert torch.equal(packed, gathered[:, offset : offset + chunk])


@pytest.mark.background_runs(
    plain=train_job(4, *SINGLE),
    streamed=train_job(4, *SINGLE, *STREAMED),
    # the same rows over two processes, each streaming its shards, with full AC and two micro-batches of a row: the
    # layout the plan gives a 7B under 32 GiB (and its 64K steps), the micro-batches' sums on the host
    sharded=train_job(4, *SINGLE, *STREAMED, "--activation_checkpoint.mode=full", "--training.batch_size=1",
                      "--training.gradient_accumulation_steps=2", nproc=2),
    lora=train_job(4, *SINGLE, "--lora.rank=4"),
    lora_streamed=train_job(4, *SINGLE, "--lora.rank=4", *STREAMED),
)
def test_a_streamed_run_trains_adamws_curve_and_resumes_exactly_with_streaming_on_or_off(background_runs, tiny_model,
                                                                                         corpus):
    plain, streamed, sharded, adapted, adapted_streamed = (background_runs[name] for name in (
        "plain", "streamed", "sharded", "lora", "lora_streamed"))
    for run in (plain, streamed, sharded, adapted, adapted_streamed):
        check(run.result)
    # LoRA: the adapters stepped, the frozen base streamed (its first step's check reads the streamed gradients)
    assert_same_curve(metrics(adapted_streamed.dump), metrics(adapted.dump), rel=1e-5)
    expected = metrics(plain.dump)
    assert expected[4]["loss_metrics/global_avg_loss"] < expected[1]["loss_metrics/global_avg_loss"] - 0.2
    assert "Parameter groups (AdamW, streamed)" in streamed.result.stdout + streamed.result.stderr
    assert_same_curve(metrics(streamed.dump), expected, rel=1e-5)  # the norm summed unit by unit: rounding apart
    # gradients reduce-scattered and summed over the micro-batches on the host, the norm all-reduced
    assert_same_curve(metrics(sharded.dump), expected, rel=5e-5)
    # the checkpoints are AdamW's (sharded: FSDP's): resumed streamed, steps 3-4 repeat bit for bit; the sharded
    # one resumed in one process without streaming, the one-process one on two processes streaming their shards
    def resume(run, where: str, *flags: str, nproc: int = 1):
        step2 = f"--checkpoint.initial_load_path={run.dump / 'checkpoint' / 'step-2'}"
        job = train_job(4, *SINGLE, *flags, step2, "--checkpoint.no-initial_load_model_only", nproc=nproc)
        return lambda: check(job(run.dump.parent / where, tiny_model, corpus))

    two_at_a_time(resume(streamed, "resumed", *STREAMED), resume(sharded, "unstreamed"),
                  resume(streamed, "resharded", *STREAMED, "--training.batch_size=2", nproc=2))
    root = streamed.dump.parent
    assert_same_curve(metrics(root / "resumed"), metrics(streamed.dump), rel=0, steps=[3, 4])
    for where, source in (("unstreamed", sharded), ("resharded", streamed)):
        assert_same_curve(metrics(root / where), metrics(source.dump), rel=5e-5, steps=[3, 4])


def test_what_streaming_cannot_run_yet_is_refused_in_one_line(tiny_model, corpus, tmp_path, monkeypatch):
    args = [*base_args(tiny_model, corpus, tmp_path / "x"), *STREAMED]
    refused = [
        (2, ["--parallelism.tensor_parallel_degree=2"],
         "shards the weights over all 2 processes.* does not combine with --parallelism.tensor_parallel_degree 2"),
        (1, ["--optimizer.name=Muon"], "--memory.stream_weights steps AdamW or Adam on the host"),
        (1, ["--optimizer.on_host"], "does not combine with --optimizer.on_host yet"),
        (1, ["--training.ema_decay=0.99"], "does not combine with --training.ema_decay yet"),
        (1, ["--training.compile"], r"does not combine with --compile.enable \(--training.compile\) yet"),
    ]
    for world_size, flags, message in refused:
        with pytest.raises(ConfigError, match=message) as error:
            parse_job(monkeypatch, world_size, *args, *flags)
        assert "\n" not in str(error.value)


def test_the_plan_streams_the_weights_where_the_rest_no_longer_fits(long_model, monkeypatch):  # noqa: F811
    """On a GPU the plan weighs streaming beside CPU offload and the optimizer on the host (never together); its
    GPU part is two blocks' weights and gradients in flight, its host part the masters, AdamW's moments and the
    compute-dtype copies, so it fits budgets nothing else does."""
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(config, 1), memory.layout_of(config)
    assert not job.can_stream  # a CPU job: nothing to stream to
    assert not any(layout.stream for layout in candidates(job, start, set(), None))
    job = dataclasses.replace(job, can_offload=True, can_step_on_host=True, can_stream=True, compute_bytes=2)
    layouts = candidates(job, start, set(), None)
    assert Layout(stream=True) in layouts and not any(lay.stream and (lay.offload or lay.host_optimizer)
                                                      for lay in layouts)
    parts = {part.name: part for part in estimate(job, Layout(stream=True))}
    in_flight = 2 * (2 * job.block_params + job.resident_params)
    assert parts["gradients in flight"].bytes == in_flight and parts["gradients in flight"].where == "GPU"
    assert parts["streamed weights"].bytes == in_flight + 8 * job.block_params  # and their float32 staging
    assert host_bytes(list(parts.values())) == pytest.approx((job.stream_pinning * (4 + 2) + 8) * job.trainable_params)
    # a budget that full AC misses by the float32 training state: streamed, it fits (the job keeps its other settings)
    budget = 1.001 * gpu_bytes(estimate(job, Layout(ac="full", stream=True)))
    kept = {"micro_batches", "offload", "host_optimizer"}
    assert not choose(dataclasses.replace(job, can_stream=False), start, kept, budget, None, lambda: H100).fits
    plan = choose(job, start, kept, budget, None, lambda: H100)
    assert plan.fits and plan.layout.stream and gpu_bytes(plan.parts) <= budget
    memory.set_layout(config, start, plan.layout)
    assert config.memory.stream_weights and memory.layout_of(config).stream
    # micro-batches sum the gradients in float32 on the host
    summed = {part.name: part for part in estimate(job, Layout(stream=True, micro_batches=2))}
    assert summed["gradient sums"].bytes == 4 * job.trainable_params and summed["gradient sums"].where == "host"
    # over two ranks each holds half of the host's part, and one block's all-gather and reduce-scatter buffers
    sharded = {part.name: part for part in estimate(dataclasses.replace(job, weight_shards=2, fsdp=True),
                                                    Layout(stream=True))}
    assert host_bytes(list(sharded.values())) == pytest.approx(host_bytes(list(parts.values())) / 2)
    assert sharded["all-gather and reduce-scatter buffers"].bytes == 1.5 * (2 + 4) * job.block_params
    # over eight, the whole float32 model each process initializes before keeping its shards is the host's peak
    eighth = estimate(dataclasses.replace(job, weight_shards=8, fsdp=True, stream_pinning=1.0), Layout(stream=True))
    assert host_bytes(eighth) == pytest.approx(4 * job.trainable_params)
    assert "the whole model, at initialization" in {part.name for part in eighth}
    # LoRA's frozen base stays on the host in its own dtype, beside the adapters' float32 masters and state
    adapted = dataclasses.replace(job, frozen_params=job.params // 2, frozen_bytes=2)
    held = {part.name: part for part in estimate(adapted, Layout(stream=True))}
    assert held["parameters"].bytes == pytest.approx(job.stream_pinning * (4 + 2) * job.params / 2)


def test_the_7b_under_32_and_24_gib_streams_its_weights(monkeypatch):
    """transformer_7B at one row of 32K tokens on an H100's rates and its host budget (90% of 128.9 GiB): at 32 and
    24 GiB only streaming fits, with full AC of most blocks, the host holding 90 GiB (FSDP's CPU offload pins
    float32 weights and gradients, each rounded up to a power of two: 116 GiB). Given a larger host, offload fits
    too, and prices above streaming (float32 weights up and gradients down, AdamW between the steps)."""
    from tests.memory.test_memory_plan import seven_b_on_an_h100

    job, rates = seven_b_on_an_h100()
    job = dataclasses.replace(job, rows=1, can_stream=True)
    for budget in (32, 24):
        plan = choose(job, Layout(), set(), budget * GIB, 115 * GIB, lambda: rates)
        assert plan.fits and plan.layout.stream and plan.layout.ac.startswith("first:"), plan.why
        # the masters and landings in 2 GiB chunks: 40 GiB for their 37.7 (a 1 GiB chunk holds two 808 MB masters)
        assert 1.05 < job.stream_pinning < 1.07 and 89 * GIB < host_bytes(plan.parts) < 92 * GIB
        unstreamed = dataclasses.replace(job, can_stream=False)
        assert not choose(unstreamed, Layout(), set(), budget * GIB, 115 * GIB, lambda: rates).fits
        roomy = choose(unstreamed, Layout(), set(), budget * GIB, 125 * GIB, lambda: rates)
        assert roomy.fits and roomy.layout.offload
        assert price(job, roomy.layout, rates).seconds > 1.1 * price(job, plan.layout, rates).seconds


def test_the_7b_at_64k_parks_its_inputs_and_at_128k_the_refusal_names_the_host(monkeypatch):
    """One row of 64K tokens under 32 and 24 GiB: streamed, with the checkpointed inputs parked on the host (105 GiB
    there). At 128K the inputs alone are 31 GiB: streamed and parked it would need 35 GiB of GPU and 121 GiB of
    host, over the H100 machine's host budget, and the refusal says so beside the smallest layout within it."""
    from tests.memory.test_memory_plan import seven_b_on_an_h100

    job, rates = seven_b_on_an_h100()
    job = dataclasses.replace(job, rows=1, can_stream=True, can_park_inputs=True)
    for budget in (32, 24):
        plan = choose(dataclasses.replace(job, tokens_per_row=65536), Layout(), set(), budget * GIB, 115 * GIB,
                      lambda: rates)
        assert plan.fits and plan.layout.stream and plan.layout.park_inputs, plan.why
        assert 100 * GIB < host_bytes(plan.parts) < 115 * GIB
    refused = choose(dataclasses.replace(job, tokens_per_row=131072), Layout(), set(), 32 * GIB, 115 * GIB,
                     lambda: rates)
    assert not refused.fits and refused.why.startswith("needs 67.")
    assert ("weights streamed from the host, checkpointed inputs on the host would need 35.20 GiB of GPU memory and "
            "121.2 GiB of host memory, over the 115.0 GiB host budget") in refused.remark

"""The memory plan (--memory.plan): what it measures, what it chooses as the budget shrinks, what it keeps."""

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaConfig

from flame import memory
from flame.errors import ConfigError
from flame.memory import activations
from flame.memory.plan import (
    GIB,
    Layout,
    activation_bytes,
    choose,
    estimate,
    gpu_bytes,
    steps,
    table,
)
from flame.models import load_model_config
from flame.models.registry import meta_model, register_all
from tests.conftest import (
    ROOT,
    TINY_DECODER,
    TOKENIZER,
    assert_same_curve,
    base_args,
    losses,
    metrics,
    parse_job,
    torchrun,
    two_at_a_time,
)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """The tiny llama with room for 512-token rows, where activations and logits are both large enough to matter."""
    path = tmp_path_factory.mktemp("model") / "llama_512.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512,
                                "vocab_size": 4096, "tie_word_embeddings": False}))
    return str(path)


def job_args(model: str, *extra: str) -> list[str]:
    return [f"--model.config={model}", f"--model.tokenizer_path={TOKENIZER}", "--training.dataset=builtin:python-stdlib",
            "--training.seq_len=512", "--training.batch_size=8", *extra]


def tiny_llama(layers: int) -> LlamaConfig:
    register_all()
    return LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": layers}, vocab_size=4096, max_position_embeddings=512)


def test_saved_bytes_grow_linearly_with_tokens_once_the_attention_weights_are_taken_out():
    config = tiny_llama(2)
    profile = activations.measure(config, torch.float32)
    assert profile.method.startswith("measured")
    block = profile.blocks[1]
    # the only T² term is math SDPA's attention weights: one fp32 T x T matrix per head
    assert block.square == TINY_DECODER["num_attention_heads"] * 4
    # a length the fit never saw: what the forward saves is exactly linear + that T² term
    model = meta_model(config).float()
    save_list = activations.compat.torchtitan.op_sac_save_list()
    for tokens in (48, 256):
        saved = activations._saved_per_block(model, tokens, save_list)[0][1]
        assert saved == pytest.approx(block.at(tokens)), tokens
    assert block.linear > 10 * profile.block_input  # a block keeps far more than its input


def test_saved_bytes_grow_linearly_with_blocks():
    two, four = (activations.measure(tiny_llama(n), torch.float32) for n in (2, 4))
    assert len(four.blocks) == 4
    assert sum(b.linear for b in four.blocks) - sum(b.linear for b in two.blocks) == pytest.approx(2 * two.blocks[1].linear)
    assert four.blocks[3] == two.blocks[1]  # the blocks after the first are alike
    assert four.rest == two.rest


def test_a_meta_forward_that_reaches_a_triton_kernel_stops_there_and_the_plan_takes_the_formula(monkeypatch):
    """On a GPU a kernel launched on meta tensors reads null pointers and poisons the process's CUDA context.

    The block that stopped leaves no dispatch mode behind: one left on the stack ran every later
    op of the training through Python (mamba2 340M at two thirds of its speed)."""
    import triton
    import triton.language as tl
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from triton.runtime.jit import KernelInterface

    @triton.jit
    def copy_kernel(x, y):
        tl.store(y, tl.load(x))

    launch = KernelInterface.__getitem__
    meta = torch.empty(1, device="meta")
    refused = pytest.raises(activations.compat.triton.KernelLaunchRefused, match="Triton kernel copy_kernel")
    with refused, activations.compat.triton.kernel_launches_refused():
        copy_kernel[(1,)](meta, meta)
    assert KernelInterface.__getitem__ is launch  # launches work again after the block

    monkeypatch.setattr(activations, "_PROFILES", {})  # measured here, not taken from an earlier test's cache
    profile = activations.measure(load_model_config(str(ROOT / "configs/tiny/gla.json")), torch.bfloat16)
    assert "the meta forward reached Triton kernel layer_norm_fwd_kernel" in profile.method  # fla's fused norm
    assert KernelInterface.__getitem__ is launch
    assert _get_current_dispatch_mode() is None


def test_full_ac_keeps_less_than_op_level_which_keeps_less_than_none(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job = memory.job_of(config, 1)
    none, op, full = (activation_bytes(job, ac) for ac in ("none", "op", "full"))
    assert full < op < none
    assert activation_bytes(job, "1") == full  # every block checkpointed
    # the last block's backward follows its forward at once: checkpointing it alone saves nothing
    assert activation_bytes(job, "2") == none
    deeper = dataclasses.replace(job, activations=job.activations.scaled(4))
    assert activation_bytes(deeper, "full") < activation_bytes(deeper, "2") < activation_bytes(deeper, "none")


def test_fsdp_resharding_comes_after_ac_and_before_offload_unless_given(long_model, monkeypatch):
    config = parse_job(monkeypatch, 2, *job_args(long_model, "--memory.plan=off"))
    job = dataclasses.replace(memory.job_of(config, 2), can_offload=True)  # as on a GPU
    gathered = Layout(reshard=False)  # as under pipeline parallelism, or fsdp_reshard_after_forward never
    names = [name for name, _ in steps(job, gathered, set(), None)]
    assert names[2:5] == ["full AC", "FSDP reshard after forward", "CPU offload"]
    assert "FSDP reshard after forward" not in [name for name, _ in steps(job, gathered, {"reshard"}, None)]
    assert gpu_bytes(estimate(job, gathered)) > gpu_bytes(estimate(job, Layout()))


def test_plan_turns_on_ac_then_offload_then_micro_batches_as_the_budget_shrinks(long_model, monkeypatch):
    config = parse_job(monkeypatch, 2, *job_args(long_model, "--memory.plan=off"))  # FSDP over 2 ranks
    job, start = dataclasses.replace(memory.job_of(config, 2), can_offload=True), memory.layout_of(config)  # as on a GPU
    ladder = steps(job, start, set(), host_budget=None)
    assert [name for name, _ in ladder] == ["as configured", "op-level selective AC", "full AC", "CPU offload",
                                            "2 micro-batches", "4 micro-batches", "8 micro-batches"]
    needs = [gpu_bytes(estimate(job, layout)) for _, layout in ladder]
    assert needs == sorted(needs, reverse=True) and len(set(needs)) == len(needs)  # each step saves memory
    for (name, layout), need in zip(ladder, needs):
        plan = choose(job, start, set(), need, None)  # the budget this layout just fits: it, not a costlier one
        assert plan.fits and plan.layout == layout, name
        assert choose(job, start, set(), need * 1.0001, None).layout == layout
    chosen = choose(job, start, set(), needs[4], None)
    assert (chosen.layout.ac, chosen.layout.offload, chosen.layout.micro_batches) == ("full", True, 2)
    shown = table(chosen, job.activations.method)
    for part in ("parameters", "gradients", "optimizer state", "FSDP all-gather buffers", "activations",
                 "logits and loss", "allocator margin", "host (CPU offload)", "plan: full AC, CPU offload, 2 micro-batches"):
        assert part in shown


def test_blocks_of_triton_kernels_checkpoint_every_nth_block_where_pytorch_blocks_take_op_level(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    measured, start = memory.job_of(config, 1), memory.layout_of(config)
    assert [name for name, _ in steps(measured, start, set(), None)][:3] == ["as configured", "op-level selective AC", "full AC"]
    formula = activations._formula(load_model_config(long_model), torch.float32, 8, "reached Triton kernel k")
    job = dataclasses.replace(measured, activations=formula)  # as for fla's models: 8 blocks of Triton kernels
    ladder = steps(job, start, set(), None)
    assert [name for name, _ in ladder][:5] == ["as configured", "selective AC every 4 blocks",
                                                "selective AC every 3 blocks", "selective AC every 2 blocks", "full AC"]
    needs = [gpu_bytes(estimate(job, layout)) for _, layout in ladder[:5]]
    assert needs == sorted(needs, reverse=True) and len(set(needs)) == 5  # each recomputes more and keeps less
    plan = choose(job, start, set(), needs[3], None)
    assert plan.layout.ac == "2"
    memory.set_layout(config, start, plan.layout)  # torchtitan's spelling: selective, option "2"
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option) == ("selective", "2")
    # a setting that already recomputes more is not undone
    assert [layout.ac for _, layout in steps(job, Layout(ac="2"), set(), None)][:2] == ["2", "full"]


def test_one_gpu_offloads_through_fsdp_over_itself_and_a_cpu_never_offloads(long_model, monkeypatch):
    config = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    on_cpu, start = memory.job_of(config, 1), memory.layout_of(config)
    assert not on_cpu.fsdp and "CPU offload" not in [name for name, _ in steps(on_cpu, start, set(), None)]
    job = dataclasses.replace(on_cpu, can_offload=True, compute_bytes=2, autocast_copies=True)  # one GPU, bf16
    ladder = dict(steps(job, start, set(), None))
    offloaded = estimate(job, ladder["CPU offload"])
    assert ladder["CPU offload"].ac == "full" and not ladder["CPU offload"].micro_batches > 1
    names = {part.name: part for part in offloaded}
    # the weights, gradients and optimizer state move to the host; FSDP's bf16 copies of one block and
    # its prefetch replace autocast's copy of every weight
    assert {names[n].where for n in ("parameters", "gradients", "optimizer state")} == {"host (CPU offload)"}
    assert "autocast weight copies" in {part.name for part in estimate(job, ladder["full AC"])}
    assert "autocast weight copies" not in names and names["FSDP all-gather buffers"].bytes == 2 * 2 * job.block_params
    assert gpu_bytes(offloaded) < gpu_bytes(estimate(job, ladder["full AC"]))
    muon = dataclasses.replace(job, optimizer="Muon")  # Muon orthogonalizes whole matrices on the GPU
    assert "CPU offload" not in dict(steps(muon, start, set(), None))


def test_a_planned_job_config_carries_the_plan_and_keeps_the_global_batch(long_model, monkeypatch):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(off, 1), memory.layout_of(off)
    two = dict(steps(job, start, set(), None))["2 micro-batches"]
    budget = 1.001 * gpu_bytes(estimate(job, two)) / GIB  # printed to 6 places: a hair above, never below
    planned = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={budget:.6f}"))
    t = planned.training
    assert (planned.activation_checkpoint.mode, t.local_batch_size, t.gradient_accumulation_steps) == ("full", 4, 2)
    assert t.global_batch_size == off.training.global_batch_size == 8


def test_a_job_that_fits_no_plan_is_refused_in_one_line_naming_the_smallest_budget(long_model, monkeypatch):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(off, 1), memory.layout_of(off)
    smallest = gpu_bytes(estimate(job, steps(job, start, set(), None)[-1][1])) / GIB
    with pytest.raises(ConfigError) as error:
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.gpu_budget_gib=0.001"))
    message = str(error.value)
    assert "\n" not in message and "does not fit the 0.00 GiB GPU budget" in message
    assert f"--memory.gpu_budget_gib {math.ceil(smallest * 100) / 100:.2f}" in message


def test_settings_given_are_kept(long_model, monkeypatch):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    job, start = memory.job_of(off, 1), memory.layout_of(off)
    full = 1.001 * gpu_bytes(estimate(job, dict(steps(job, start, set(), None))["full AC"])) / GIB
    # a budget full AC fits: without AC given, the plan takes it; with --activation_checkpoint.mode none, micro-batches
    kept = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full:.6f}",
                                               "--activation_checkpoint.mode=none"))
    assert kept.activation_checkpoint.mode == "none" and kept.training.gradient_accumulation_steps > 1
    given = parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full:.6f}",
                                                "--training.gradient_accumulation_steps=1"))
    assert given.activation_checkpoint.mode == "full" and given.training.local_batch_size == 8
    with pytest.raises(ConfigError, match="does not fit"):  # the only way left would be micro-batches
        parse_job(monkeypatch, 1, *job_args(long_model, f"--memory.gpu_budget_gib={full * 0.9:.6f}",
                                            "--training.gradient_accumulation_steps=1"))


def test_plan_off_changes_nothing_and_takes_no_budget(long_model, monkeypatch):
    off = parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off"))
    assert (off.activation_checkpoint.mode, off.training.local_batch_size, off.training.gradient_accumulation_steps,
            off.training.enable_cpu_offload) == ("none", 8, 1, False)
    with pytest.raises(ConfigError, match="--memory.gpu_budget_gib is a budget for the memory plan, and --memory.plan is off"):
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.plan=off", "--memory.gpu_budget_gib=1"))
    with pytest.raises(ConfigError, match="--memory.gpu_budget_gib must be auto or a positive number of GiB, got 'x'"):
        parse_job(monkeypatch, 1, *job_args(long_model, "--memory.gpu_budget_gib=x"))


def test_micro_batched_plan_trains_the_same_loss_curve(tiny_model, corpus, tmp_path, monkeypatch):
    args = base_args(tiny_model, corpus, tmp_path / "x", steps=3)[:-1]  # batch_size 2, seq_len 64
    off = parse_job(monkeypatch, 1, *args, f"--job.dump_folder={tmp_path / 'off'}", "--memory.plan=off")
    job, start = memory.job_of(off, 1), memory.layout_of(off)
    two = dict(steps(job, start, set(), None))["2 micro-batches"]
    budget = f"--memory.gpu_budget_gib={1.001 * gpu_bytes(estimate(job, two)) / GIB:.9f}"
    reference, planned = two_at_a_time(
        lambda: torchrun([*args, f"--job.dump_folder={tmp_path / 'off'}", "--memory.plan=off"]),
        lambda: torchrun([*args, f"--job.dump_folder={tmp_path / 'planned'}", budget]),
    )
    for result in (reference, planned):
        assert result.returncode == 0, result.stderr[-4000:]
    log = planned.stdout + planned.stderr
    assert "Memory plan" in log and "plan: full AC, 2 micro-batches" in log and "optimizer state" in log
    assert "Memory plan" not in reference.stdout + reference.stderr
    assert len(losses(tmp_path / "planned")) == 3
    assert_same_curve(losses_and_norms(tmp_path / "planned"), losses_and_norms(tmp_path / "off"), rel=1e-5)


def losses_and_norms(dump) -> dict[int, dict]:
    return {step: row for step, row in metrics(dump).items() if "grad_norm" in row}

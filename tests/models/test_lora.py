"""LoRA fine-tuning (--lora.*): flame trains what PEFT's own loop trains, under FSDP too, resumes
exactly, and exports adapters that PEFT loads.

Every run starts from one pretrained base (a tiny llama saved as an HF model, converted to each
run's step-0 checkpoint), as a LoRA fine-tune does.
"""

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from flame.launch import preflight
from tests.conftest import (SCRIPTS, TINY_DECODER, TOKENIZER, assert_same_curve, base_args, check, metrics, torchrun,
                            two_at_a_time)
from tests.checkpoint.test_export import convert

RANK, ALPHA = 4, 8
LAYERS = 2 * 7  # all-linear: q, k, v, o and the three MLP projections of 2 blocks
LINEAR_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
                 "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # (in, out)


def lora_args(base: Path, corpus: str, dump: Path, steps: int, batch_size: int) -> list[str]:
    """4 rows of 64 tokens per step: ``batch_size`` 4 in one process, 2 on each of 2 FSDP ranks."""
    # causal attention over whole rows (no document mask), which PEFT's HF model computes alike
    return base_args(str(base), corpus, dump, steps=steps) + [
        f"--training.batch_size={batch_size}", "--training.no-document_mask", "--optimizer.lr=1e-2",
        "--checkpoint.interval=2", f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> SimpleNamespace:
    """The base model; 4 steps in one process against PEFT's loop, and under FSDP 2; the first resumed from its step 2."""
    from flame.models import load_model_config

    root = tmp_path_factory.mktemp("lora")
    config = root / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512,
                                  "vocab_size": 4096, "tie_word_embeddings": False}))
    torch.manual_seed(0)
    base = root / "base"
    AutoModelForCausalLM.from_config(load_model_config(str(config))).save_pretrained(base)
    single, fsdp, resumed, parity = root / "single", root / "fsdp", root / "resumed", root / "parity.pt"
    for dump in (single, fsdp):
        convert("flame.utils.convert_hf_to_dcp", "--model", str(base), "--checkpoint", str(dump / "checkpoint" / "step-0"))

    def single_then_resumed():
        result = check(torchrun([str(base), str(parity), *lora_args(base, corpus, single, 4, 4)],
                                module=str(SCRIPTS / "lora_parity.py")))
        load = [f"--checkpoint.initial_load_path={single / 'checkpoint' / 'step-2'}", "--checkpoint.no-initial_load_model_only"]
        check(torchrun(lora_args(base, corpus, resumed, 4, 4) + load))
        return result

    fsdp_run = partial(torchrun, lora_args(base, corpus, fsdp, 4, 2), nproc=2)
    single_result, fsdp_result = two_at_a_time(single_then_resumed, fsdp_run)
    check(fsdp_result)
    return SimpleNamespace(base=base, single=single, fsdp=fsdp, resumed=resumed, parity=torch.load(parity),
                           log=single_result.stdout + single_result.stderr)


def test_flame_lora_trains_as_peft_own_training_loop(runs):
    parity = runs.parity
    base = AutoModelForCausalLM.from_pretrained(runs.base).state_dict()
    start = parity["start"]
    for name, tensor in start.items():
        if ".lora_" not in name:  # the step-0 checkpoint's weights, under PEFT's layer names
            assert torch.equal(tensor, base[name.replace(".base_layer", "")]), name
    adapters = {name: tensor for name, tensor in start.items() if ".lora_" in name}
    assert len(adapters) == 2 * LAYERS
    for name, tensor in adapters.items():  # PEFT's init: B zero, A kaiming-uniform (bound 1/sqrt(in))
        if ".lora_B." in name:
            assert not tensor.any(), name
        else:
            assert tensor.abs().max() <= tensor.shape[1] ** -0.5 and tensor.std() > 0.3 * tensor.shape[1] ** -0.5, name
    assert len(parity["flame_losses"]) == 4
    for flame_loss, peft_loss in zip(parity["flame_losses"], parity["peft_losses"], strict=True):
        assert flame_loss == pytest.approx(peft_loss, rel=1e-6)
    assert parity["flame_losses"][-1] < parity["flame_losses"][0] - 0.01  # the adapters learned
    torch.testing.assert_close(parity["flame_logits"], parity["peft_logits"], rtol=1e-4, atol=1e-5)
    trainable = 2 * sum(RANK * (fan_in + fan_out) for fan_in, fan_out in LINEAR_SHAPES.values())
    assert f"LoRA: {trainable:,} trainable parameters of " in runs.log


def test_fsdp_and_a_resume_train_the_single_process_curve(runs):
    expected = metrics(runs.single)
    assert_same_curve(metrics(runs.fsdp), expected, rel=1e-5)
    # the adapters, their optimizer state, the schedule and the data carry on from step 2
    resumed = metrics(runs.resumed)
    assert sorted(resumed) == [3, 4]
    assert_same_curve(resumed, expected, rel=1e-6, steps=[3, 4])
    saved = dcp.FileSystemReader(runs.fsdp / "checkpoint" / "step-2").read_metadata().state_dict_metadata
    # the base weights under the plain model's names, the adapters with their optimizer state
    assert "model.layers.0.self_attn.q_proj.weight" in saved and "model.layers.0.self_attn.q_proj.lora_A.weight" in saved
    state = [name for name in saved if name.startswith("optimizer.state.")]
    assert state and all(".lora_" in name for name in state)


def test_exported_adapter_loads_with_peft_and_the_merged_model_alone(runs, tmp_path):
    from peft import PeftModel

    convert("flame.utils.convert_dcp_to_hf", "--path", str(runs.single), "--out", str(tmp_path / "adapter"))
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(runs.base) and settings["r"] == RANK
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(settings["base_model_name_or_path"]),
                                      tmp_path / "adapter")
    ids = torch.arange(3, 3 + 2 * 48).remainder(4096).reshape(2, 48)
    expected = runs.parity["flame_logits"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)

    convert("flame.utils.convert_dcp_to_hf", "--path", str(runs.single), "--lora_export", "merged", "--out",
            str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_lora_counts_frozen_weights_without_their_weight_gradient(monkeypatch, tiny_model):
    from flame.prepare import settled
    from flame.models.builder import FlameModelArgs, build_model
    from flame.models.flops import model_flops

    def flops(*flags: str):
        monkeypatch.setenv("WORLD_SIZE", "1")
        job = settled([f"--model.config={tiny_model}", f"--model.tokenizer_path={TOKENIZER}",
                                               "--training.dataset=builtin:python-stdlib", *flags])
        args = FlameModelArgs()
        args.update_from_config(job)
        with torch.device("meta"):
            return model_flops(build_model(args))

    full, adapted = flops(), flops("--lora.rank=4", "--lora.targets=q_proj,v_proj", "--lora.dropout=0.1")
    trained = 2 * RANK * (64 + 64 + 64 + 32)  # q and v adapters of 2 blocks
    assert adapted.matmul_params == full.matmul_params + trained
    assert adapted.dense_per_token == 4 * full.matmul_params + 6 * trained
    # adapters on the last block only: the first runs no backward (2 x its weights, a third of its attention)
    late = flops("--lora.rank=4", "--lora.targets=layers.1.self_attn.q_proj")
    block = sum(fan_in * fan_out for fan_in, fan_out in LINEAR_SHAPES.values())
    assert late.dense_per_token == 4 * full.matmul_params - 2 * block + 6 * RANK * 128
    assert late.attention_widths[None] == pytest.approx(full.attention_widths[None] * (1 / 3 + 1) / 2)


def test_the_fused_loss_computes_no_weight_gradient_for_a_frozen_head():
    from flame.models.loss import linear_cross_entropy_sum

    torch.manual_seed(0)
    hidden, targets = torch.randn(30, 16, requires_grad=True), torch.randint(0, 50, (30,))
    trained, frozen = torch.randn(50, 16, requires_grad=True), torch.randn(50, 16)
    frozen.copy_(trained.detach())
    expected = torch.autograd.grad(linear_cross_entropy_sum(hidden, trained, None, targets), hidden)[0]
    loss = linear_cross_entropy_sum(hidden, frozen, None, targets)
    assert loss.grad_fn.saved_tensors[1] is None  # no vocabulary x hidden fp32 buffer kept for it
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0], expected)


@pytest.mark.parametrize(
    "world_size, flags, message",
    [
        (1, ["--lora.rank=0"], "--lora.rank must be a positive number of adapter dimensions (e.g. 16), got 0"),
        (1, ["--lora.alpha=32"], "--lora.alpha sets up LoRA, which is off: add --lora.rank"),
        (1, ["--lora.rank=8", "--lora.targets=all-linear,q_proj"], "or all-linear alone"),
        (1, ["--lora.rank=8", "--lora.targets=q_proj,query"],
         "--lora.targets query matches no linear layer of llama; its linear layers are self_attn.q_proj, "
         "self_attn.k_proj, self_attn.v_proj, self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj"),
        (1, ["--lora.rank=8", "--lora.targets=lm_head"], "not on the output head"),
        (2, ["--lora.rank=8", "--parallelism.tensor_parallel_degree=2"], "LoRA's adapter layers take no tensor-parallel plan"),
    ],
)
def test_bad_lora_settings_are_one_line_errors_before_training(tmp_path, capsys, monkeypatch, tiny_model, world_size,
                                                              flags, message):
    args = [f"--model.config={tiny_model}", f"--model.tokenizer_path={TOKENIZER}",
            "--training.dataset=builtin:python-stdlib", "--training.seq_len=64", *flags]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    assert preflight.main(["--world-size", str(world_size), "--", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("flame: error: ") and "\n" not in error
    assert message in error


def test_the_frozen_base_held_in_bf16_trains_the_adapters_as_its_float32_copy_does(monkeypatch, tmp_path):
    """lora.hold_base_in, what a bf16 GPU run does to its LoRA model before sharding it: the base's weights (a
    tied embedding and head included, still one weight) held in bf16, the adapters in float32; under bf16
    autocast the adapters get the gradients the float32 base of the same values gives them; a checkpoint of the
    bf16 base loads back into a float32 model (the export's) unchanged."""
    from flame.models import lora
    from flame.models.builder import FlameModelArgs, build_model
    from flame.prepare import settled

    config = tmp_path / "tied.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512,
                                  "vocab_size": 4096, "tie_word_embeddings": True}))
    monkeypatch.setenv("WORLD_SIZE", "1")
    job = settled([f"--model.config={config}", f"--model.tokenizer_path={TOKENIZER}",
                   "--training.dataset=builtin:python-stdlib", f"--lora.rank={RANK}", "--lora.targets=all-linear"])

    def model(held_in: torch.dtype | None) -> torch.nn.Module:
        args = FlameModelArgs()
        args.update_from_config(job)
        with torch.device("meta"):
            built = build_model(args)
        held = lora.hold_base_in(built, held_in) if held_in else 0
        built.to_empty(device="cpu")
        torch.manual_seed(0)
        built.init_weights()
        return built, held

    bf16, held = model(torch.bfloat16)
    f32, _ = model(None)
    frozen = {id(p): p for p in bf16.parameters() if not p.requires_grad}.values()
    assert held == sum(p.numel() for p in frozen) > 0 and {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in bf16.parameters() if p.requires_grad} == {torch.float32}
    assert bf16.get_output_embeddings().weight is bf16.get_input_embeddings().weight
    with torch.no_grad():  # the same values: the float32 model takes the bf16 ones
        for name, param in f32.named_parameters():
            param.copy_(bf16.get_parameter(name))
    ids = torch.randint(0, 4096, (2, 32))
    grads = []
    for m in (bf16, f32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(ids, labels=ids).loss.backward()
        assert all(p.grad is None for p in m.parameters() if not p.requires_grad)
        grads.append({name: p.grad.float() for name, p in m.named_parameters() if p.requires_grad})
    for name, grad in grads[1].items():  # within bf16 noise (the bf16 embedding makes a bf16 residual stream)
        assert (grads[0][name] - grad).norm() <= 0.02 * grad.norm(), name
    # the adapters take their input as it comes (bf16), not a float32 copy that autocast casts back: the same result
    seen = []
    hooks = [layer.lora_A["default"].register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].dtype))
             for layer in lora.adapted_modules(bf16)]
    bf16.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bf16(ids, labels=ids).loss
    loss.backward()
    assert set(seen) == {torch.bfloat16}
    copied = {name: p.grad.clone() for name, p in bf16.named_parameters() if p.requires_grad}
    for layer in lora.adapted_modules(bf16):
        layer.cast_input_dtype_enabled = True  # PEFT's default
    bf16.zero_grad()
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = bf16(ids, labels=ids).loss
    again.backward()
    assert set(seen) == {torch.float32} and torch.equal(again, loss)
    for name, p in bf16.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, copied[name]), name
    for hook in hooks:
        hook.remove()
    dcp.save(lora.checkpoint_weights(bf16), checkpoint_id=str(tmp_path / "step"), no_dist=True)
    restored = lora.checkpoint_weights(f32)
    dcp.load(restored, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    for name, tensor in lora.checkpoint_weights(bf16).items():
        assert restored[name].dtype == torch.float32 and torch.equal(restored[name], tensor.float()), name


def _adapted_linear(dropout: float = 0.0):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"]), model)
    layer = model[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # PEFT starts B at zero: the product would be too
    return layer


def test_a_plain_adapter_s_product_is_added_in_its_matmul_with_peft_s_values_and_gradients():
    from flame import compat

    compat.peft.adapter_added_in_its_matmul()
    layer = _adapted_linear()
    assert type(layer).forward.adds_in_the_matmul and compat.peft._vanilla_adapter(layer) == "default"
    assert compat.peft._vanilla_adapter(_adapted_linear(dropout=0.1)) is None  # dropout: upstream's forward
    x = torch.randn(2, 5, 32, requires_grad=True)
    a, b, scaling = layer.lora_A["default"], layer.lora_B["default"], layer.scaling["default"]
    assert scaling == 2.0
    got = layer(x)
    expected = layer.base_layer(x) + b(a(x)) * scaling  # upstream's sum
    torch.testing.assert_close(got, expected)
    weights = torch.randn_like(got)
    grads = torch.autograd.grad((got * weights).sum(), [x, a.weight, b.weight])
    expected_grads = torch.autograd.grad((expected * weights).sum(), [x, a.weight, b.weight])
    for one, other in zip(grads, expected_grads):
        torch.testing.assert_close(one, other)
    with torch.autocast("cpu", torch.bfloat16):  # one GPU's autocast: bf16 out, as upstream's
        mixed = layer(x)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), expected, rtol=2e-2, atol=5e-2)

"""FP8 training (--float8.recipe_name, flame.models.float8) on CPUs, where torchao emulates the FP8 matmuls (cast to
FP8 and back, multiplied in float32): which layers convert, a converted layer beside its plain twin, FSDP 2 with the
weights all-gathered in FP8 against FSDP casting them after a float32 gather and against one process, an exact
resume, a checkpoint that holds the plain model's weights, and the spellings of older flame and torchtitan job files.
Speed and the measured choice of layers (--float8.layers auto) need an FP8 GPU: tests/gpu/test_float8_gpu.py."""


import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM

from flame.base.errors import ConfigError
from flame.models import float8, lora, registry
from flame.models.kernels import attention
from flame.models.kernels.fused import use_fused_kernels
from flame.models.lora import LoraSettings
from flame.prepare import settled
from flame.models import load_model_config
from tests.conftest import ROOT, TINY_DECODER, TOKENIZER, assert_same_curve, check, metrics, train_job

FP8 = ("--float8.recipe_name=tensorwise", "--float8.layers=all")
# one row a micro-batch: one process (2 micro-batches) and two ranks (one each) put the same rows together, so FP8's
# per-call scales, taken over each micro-batch, are the same on both (flame.data deals rows to ranks round-robin)
GLOBAL_2 = ("--training.global_batch_size=2", "--training.batch_size=1", "--checkpoint.interval=2")
LOSS = "loss_metrics/global_avg_loss"


def meta_model(model_type: str, **extra):
    config = AutoConfig.for_model(model_type, **{**TINY_DECODER, "vocab_size": 512, **extra})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_eligible_layers_leave_out_the_head_the_routers_the_adapters_and_the_filter():
    llama = meta_model("llama")
    eligible = float8.eligible_layers(llama)
    assert len(eligible) == 2 * 7 and "lm_head" not in eligible  # q, k, v, o, gate, up, down a block
    assert eligible["model.layers.0.self_attn.k_proj"] == (64, 32)  # 2 key/value heads of 16
    kept = float8.eligible_layers(llama, skip=("o_proj", "model.layers.1.mlp.down_proj"))
    assert sorted(set(eligible) - set(kept)) == ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj",
                                                 "model.layers.1.self_attn.o_proj"]
    moe = meta_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    assert not any("gate" in name and "proj" not in name for name in float8.eligible_layers(moe))  # no router
    assert any(name.endswith("self_attn.q_proj") for name in float8.eligible_layers(moe))
    adapted = meta_model("llama")
    lora.add_adapters(adapted, LoraSettings(rank=16, alpha=32.0, dropout=0.0, targets=("q_proj",)))
    names = float8.eligible_layers(adapted)
    assert "model.layers.0.self_attn.q_proj.base_layer" in names  # the frozen base converts, its adapters do not
    assert not any("lora_" in name for name in names)
    with pytest.raises(ConfigError, match=r"^--float8.filter_fqns o_prj names no linear layer of llama; its linear "
                                          r"layers are self_attn.q_proj, .*mlp.down_proj, lm_head: name some"):
        float8.eligible_layers(llama, skip=("o_prj",))
    odd = meta_model("llama", hidden_size=72, intermediate_size=136)  # no multiple of 16
    assert float8.eligible_layers(odd) == {}


def test_layers_that_read_one_input_are_grouped_by_a_meta_forward():
    """--float8.layers auto times together the layers a block calls on one input (FP8 casts it once for them where
    the blocks are compiled): found by a forward on the meta device, as the model is built; per layer where none
    runs."""
    llama = meta_model("llama")
    names = list(float8.eligible_layers(llama))
    groups = float8.input_groups(llama, names)
    # as flame builds it for a GPU: its attention, fused norms and MLPs, whose meta forwards run their stand-ins
    registry.register_all()  # flame's attention among transformers' implementations, as the trainer's start does
    flames = meta_model("llama")
    flames.set_attn_implementation(attention.HF_ATTENTION)
    use_fused_kernels(flames)
    assert float8.input_groups(flames, names) == groups
    block = "model.layers.1."
    assert [tuple(name.removeprefix(block) for name in group) for group in groups if group[0].startswith(block)] == [
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]
    assert sorted(name for group in groups for name in group) == sorted(names)  # each layer once
    # LoRA's frozen base layers read the block's input as the plain ones do (their adapters read it too)
    adapted = meta_model("llama")
    lora.add_adapters(adapted, LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=("all-linear",)))
    base = list(float8.eligible_layers(adapted))
    assert ("model.layers.0.mlp.gate_proj.base_layer", "model.layers.0.mlp.up_proj.base_layer") in float8.input_groups(
        adapted, base)
    # built on real memory (no meta forward to read): each layer alone
    real = AutoModelForCausalLM.from_config(llama.config)
    assert float8.input_groups(real, names) == [(name,) for name in names]


def test_an_fla_mlps_converted_down_projection_is_called_not_read_by_the_fused_kernel():
    """fla's GatedMLP hands down_proj's weight to its fused SwiGLU+Linear kernel: a converted down projection would
    compute in bf16 there while the log counts it in FP8. Converted, the MLP calls it (SwiGLU, then the layer)."""
    model = registry.meta_model(load_model_config(str(ROOT / "configs" / "tiny" / "transformer.json")))
    mlps = [module for module in model.modules() if hasattr(module, "fuse_swiglu")]
    assert mlps and all(mlp.fuse_swiglu for mlp in mlps)  # fla's default
    settings = float8.Float8Settings(recipe="tensorwise", layers="all", skip=(), all_gather=False, precompute=False)
    float8.convert(model, settings, tokens=64, compiled=float8.EAGER, fsdp=False)
    assert all(type(mlp.down_proj).__name__ == "Float8Linear" and not mlp.fuse_swiglu for mlp in mlps)
    # LoRA's adapters on the same path: unfused where one wraps the down projection, else left fused
    for targets, fused in (("q_proj",), True), (("down_proj",), False):
        adapted = registry.meta_model(load_model_config(str(ROOT / "configs" / "tiny" / "transformer.json")))
        lora.add_adapters(adapted, LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=targets))
        assert all(module.fuse_swiglu == fused for module in adapted.modules() if hasattr(module, "fuse_swiglu"))


def test_converted_layers_compute_what_fp8_rounding_allows_and_learn():
    """One converted layer against its plain twin: outputs within FP8's rounding (e4m3: 3 mantissa bits), gradients
    too, and not equal (the cast happened)."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32))
    converted = torch.nn.Sequential(torch.nn.Linear(64, 32))
    converted.load_state_dict(plain.state_dict())
    settings = float8.Float8Settings(recipe="tensorwise", layers="all", skip=(), all_gather=False, precompute=False)
    float8._torchao_float8().convert_to_float8_training(converted, config=float8.torchao_config(settings, fsdp=False))
    assert type(converted[0]).__name__ == "Float8Linear"
    rows = torch.randn(16, 64)
    expected, got = plain(rows), converted(rows)
    assert not torch.equal(expected, got)
    assert (got - expected).norm() / expected.norm() < 0.1
    expected.square().sum().backward()
    got.square().sum().backward()
    assert (converted[0].weight.grad - plain[0].weight.grad).norm() / plain[0].weight.grad.norm() < 0.1


def test_layers_compiled_one_by_one_compute_as_before_in_one_graph_a_shape():
    """Under --training.compile, where a type's blocks stay eager, each converted layer is compiled on its own (its
    casts fuse around the matmul): the same outputs and gradients as the layers uncompiled, and layers of one shape
    share one graph, so a 7B's 224 layers stay far under dynamo's recompile limit (here the CPU's emulated FP8 and
    dynamo's eager backend)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    def stack():
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)],
                                   *[torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
                                     for _ in range(5)])
    compiled, plain = stack(), stack()
    plain.load_state_dict(compiled.state_dict())
    settings = float8.Float8Settings(recipe="tensorwise", layers="all", skip=(), all_gather=False, precompute=False)
    for model in (compiled, plain):
        float8._torchao_float8().convert_to_float8_training(model, config=float8.torchao_config(settings, fsdp=False))
    converted = [module for module in compiled.modules() if type(module).__name__ == "Float8Linear"]
    assert len(converted) == 16
    torch._dynamo.reset()
    counters.clear()
    float8.compile_each(converted, backend="eager")
    rows = torch.randn(32, 64, requires_grad=True)  # as a block's hidden states
    got, expected = compiled(rows), plain(rows)
    assert torch.equal(got, expected)
    got.square().sum().backward()
    expected.square().sum().backward()
    for mine, theirs in zip(compiled.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    assert counters["stats"]["unique_graphs"] == 3  # 64x64, 64x128 and 128x64
    # more shapes than dynamo's default limit of 8 graphs a function (which would leave the rest eager): all compiled
    widths = [64 + 16 * i for i in range(12)]
    many = torch.nn.Sequential(*[torch.nn.Linear(k, n) for k, n in zip(widths, widths[1:])])
    float8._torchao_float8().convert_to_float8_training(many, config=float8.torchao_config(settings, fsdp=False))
    torch._dynamo.reset()
    counters.clear()
    float8.compile_each(list(many), backend="eager")
    many(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 11


@pytest.mark.background_runs(
    fp8=train_job(4, *FP8, *GLOBAL_2),
    fsdp2=train_job(4, *FP8, *GLOBAL_2, nproc=2),
    fsdp2_cast_after=train_job(4, *FP8, *GLOBAL_2, "--float8.no-enable_fsdp_float8_all_gather", nproc=2),
)
def test_fp8_trains_gathers_in_fp8_exactly_and_resumes_exactly(background_runs, tiny_model, corpus, tmp_path):
    runs = {name: (run, metrics(run.dump)) for name, run in background_runs.items() if check(run.result)}
    (fp8, one), (fsdp2, two), (_, cast_after) = (runs[name] for name in background_runs)
    assert "FP8 (tensorwise): 14 of 14 eligible linear layers" in fp8.result.stdout + fp8.result.stderr
    assert "(weights all-gathered in FP8)" in fsdp2.result.stdout + fsdp2.result.stderr
    for step in range(1, 5):
        # FSDP's all-gather of FP8 weights (scaled by the whole weight's amax, precomputed after each update) gives
        # exactly what casting the gathered float32 weights gives
        assert (two[step][LOSS], two[step]["grad_norm"]) == (cast_after[step][LOSS], cast_after[step]["grad_norm"])

    # FSDP 2 trains one process's curve: only the sums' order differs, which can flip the FP8 rounding of a value on
    # a boundary (grad norms up to 7e-4 apart, depending on the CPU's vector instructions)
    assert_same_curve(two, one, rel=2e-3)
    assert one[4][LOSS] < one[1][LOSS] - 0.05
    # the checkpoint holds the plain model's weights, under their names and shapes
    saved = dcp.FileSystemReader(str(fp8.dump / "checkpoint" / "step-4")).read_metadata().state_dict_metadata
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    weights = {name: tuple(tensor.shape) for name, tensor in plain.state_dict().items()}
    assert {name: tuple(saved[name].size) for name in weights if name in saved} == weights
    assert not any("float8" in name or "scale" in name for name in saved)
    resumed = tmp_path / "resumed"
    check(train_job(4, *FP8, *GLOBAL_2, f"--checkpoint.initial_load_path={fp8.dump / 'checkpoint' / 'step-2'}",
                    "--checkpoint.no-initial_load_model_only")(resumed, tiny_model, corpus))
    again = metrics(resumed)
    for step in (3, 4):
        assert again[step][LOSS] == one[step][LOSS] and again[step]["grad_norm"] == one[step]["grad_norm"], step


def job(model: str, *flags: str, world: int = 1):
    return settled([f"--model.config={model}", "--training.dataset=builtin:python-stdlib",
                    f"--model.tokenizer_path={TOKENIZER}", *flags], world)


def test_older_and_torchtitan_spellings_turn_fp8_on(tiny_model, tmp_path):
    assert job(tiny_model, "--float8.enable_float8_linear").float8.recipe_name == "tensorwise"
    toml = tmp_path / "torchtitan.toml"
    toml.write_text('[model]\nconverters = ["quantize.linear.float8"]\n'
                    '[quantize.linear.float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["output", "auto_filter_small_kn"]\n')
    config = job(tiny_model, f"--job.config_file={toml}").float8
    assert (config.recipe_name, config.layers, config.filter_fqns) == ("rowwise", "auto", [])  # output: their head
    toml.write_text('[model]\nconverters = ["float8"]\n')  # torchtitan 0.1's name, every layer as torchtitan converts
    config = job(tiny_model, f"--job.config_file={toml}").float8
    assert (config.recipe_name, config.layers, config.enable_fsdp_float8_all_gather) == ("tensorwise", "all", False)


@pytest.mark.parametrize(("flags", "message"), [
    (("--float8.recipe_name=tensorwise", "--parallelism.tensor_parallel_degree=2"),
     r"^--float8.recipe_name with --parallelism.tensor_parallel_degree 2: .*shard with FSDP"),
    (("--model.converters=float8", "--float8.recipe_name=rowwise"), r"the same setting; give only --float8.recipe_name$"),
    (("--model.converters=mx",), r"^--model.converters is a torchtitan option flame does not use: .*MX formats"),
])
def test_fp8_settings_flame_cannot_run_are_refused_in_one_line(tiny_model, flags, message):
    with pytest.raises(ConfigError, match=message) as refused:
        job(tiny_model, *flags, world=2)
    assert "\n" not in str(refused.value)

"""The capability records (flame.models.support): one per model type, and every check and table reads them.

Each consumer test changes one field of one record (``record`` below) and checks that the consumer
follows: a test that passed with the old per-file tables and fails here means a table survived.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from flame.base import device
from flame.distributed.context_parallel import check_context_parallel
from flame.distributed.tensor_parallel import PLANS, plan_for
from flame.base.errors import ConfigError
from flame.models import load_model_config, registry, support, support_table
from flame.models.builder import FlameModelArgs, build_model
from flame.models.flops import model_flops
from flame.models.inputs import flattens_rows, keeps_rows_whole
from flame.models.support import (
    GENERIC,
    RECORDS,
    ContextParallelism,
    Documents,
    GradientSpikes,
    Package,
    support_for,
)
from flame.prepare.model import ModelUnderCheck, check_model_options
from tests.conftest import ROOT, TINY_DECODER, parse_job

LLAMA = str(ROOT / "configs/tiny/llama.json")
GLA = str(ROOT / "configs/tiny/gla.json")


def record(monkeypatch, model_type: str, **changes) -> None:
    """Change fields of ``model_type``'s record for this test."""
    monkeypatch.setitem(RECORDS, model_type, dataclasses.replace(RECORDS[model_type], **changes))


def job(monkeypatch, config_path: str, *flags: str):
    return parse_job(monkeypatch, 1, f"--model.config={config_path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                     "--training.dataset=builtin:python-stdlib", *flags)


def test_every_type_fla_registers_has_its_own_record():
    fla_records = {name for name, r in RECORDS.items() if r.library == "fla"}
    assert fla_records == registry.fla_model_types()  # none falls to the generic record, none is stale
    assert {"llama", "mistral", "qwen2", "qwen3", "gpt2", "flame_example_lm"} <= RECORDS.keys()
    assert all(support_for(name) is r and r.model_type == name for name, r in RECORDS.items())


def test_records_name_real_plans_and_layers():
    assert {r.tensor_parallel_plan for r in RECORDS.values()} - {None} == PLANS.keys()
    registry.import_fla()
    import fla.layers

    for r in RECORDS.values():
        assert all(isinstance(getattr(fla.layers, layer, None), type) for layer in r.softmax_layers), r.model_type
        assert (r.documents is Documents.ROWS_WHOLE) == bool(r.not_isolated_because), r.model_type


def test_any_other_transformers_model_gets_the_generic_record():
    gemma = support_for(AutoConfig.for_model("gemma2", **TINY_DECODER, head_dim=16))
    assert gemma == dataclasses.replace(GENERIC, model_type="gemma2")
    assert (gemma.documents, gemma.tensor_parallel_plan, gemma.context_parallel) == (
        Documents.ATTENTION, None, ContextParallelism.NONE)
    assert gemma.compile_fails is None and gemma.cuda_only is None and not gemma.packages
    assert gemma.name == "gemma2" and support_for("gla").name == "fla's gla"


def test_the_readme_table_is_generated_from_the_records():
    readme = (ROOT / "docs" / "models.md").read_text()
    assert support_table.page_with_table(readme) == readme, (
        "docs/models.md's support table differs from the records in flame/models/support.py: "
        "run `python -m flame.models --write_docs`"
    )


def test_python_m_flame_models_prints_the_table(capsys):
    assert support_table.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["model", "type", "from"]
    assert len(lines) == 1 + len(RECORDS) + 1  # the header, every record, the generic one
    assert support_table.main(["--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| model type | from | family | documents isolated |")


# one consumer per field


def test_documents_decide_how_a_batch_is_laid_out(monkeypatch):
    gla = load_model_config(GLA)
    assert flattens_rows(SimpleNamespace(config=gla)) and not keeps_rows_whole(gla)
    record(monkeypatch, "gla", documents=Documents.ROWS_WHOLE, not_isolated_because="a test")
    assert keeps_rows_whole(gla) and not flattens_rows(SimpleNamespace(config=gla))


def test_float32_refused_by_refuses_float32_jobs(monkeypatch):
    record(monkeypatch, "llama", float32_refused_by="test_kernel")
    with pytest.raises(ConfigError, match=r"llama kernel \(test_kernel\) refuses float32"):
        check_model_options(ModelUnderCheck(load_model_config(LLAMA)), job(monkeypatch, LLAMA))  # CPU: float32


def test_cuda_only_refuses_cpu_machines(monkeypatch):
    record(monkeypatch, "llama", cuda_only="runs test kernels")
    monkeypatch.setattr(device, "CUDA", False)
    with pytest.raises(ConfigError, match="llama runs test kernels, which need a CUDA GPU"):
        check_model_options(ModelUnderCheck(load_model_config(LLAMA)), job(monkeypatch, LLAMA))


def test_packages_are_checked_with_their_options(monkeypatch):
    package = Package("no_such_module_for_flame", "pip install no-such", "a test kernel", option="use_test")
    record(monkeypatch, "llama", packages=(package,))
    config = load_model_config(LLAMA)
    check_model_options(ModelUnderCheck(config), job(monkeypatch, LLAMA))  # the option is off
    config.use_test = True
    with pytest.raises(ConfigError, match=r"llama with use_test true needs a test kernel: pip install no-such"):
        check_model_options(ModelUnderCheck(config), job(monkeypatch, LLAMA))


def test_tensor_parallel_plan_is_the_one_the_record_names(monkeypatch):
    assert plan_for("llama") is PLANS["hf_decoder"] and plan_for("qwen3") is PLANS["hf_decoder"]
    record(monkeypatch, "llama", tensor_parallel_plan="gla")
    assert plan_for("llama") is PLANS["gla"]
    record(monkeypatch, "llama", tensor_parallel_plan=None)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for model_type 'llama'; plans exist for "
                                          "delta_net, flame_example_lm, gated_deltanet, gla, gsa, mamba2, mistral"):
        plan_for("llama")


def test_context_parallel_mode_is_checked(monkeypatch):
    p = SimpleNamespace(context_parallel_degree=2, tensor_parallel_degree=1, pipeline_parallel_degree=1,
                        context_parallel_load_balancer="headtail", context_parallel_rotate_method="allgather")
    cp_job = SimpleNamespace(parallelism=p, training=SimpleNamespace(local_batch_size=1, seq_len=64))
    config = load_model_config(LLAMA)
    check_context_parallel(config, cp_job)
    record(monkeypatch, "llama", context_parallel=ContextParallelism.NONE)
    with pytest.raises(ConfigError, match="llama cannot run context parallel"):
        check_context_parallel(config, cp_job)
    record(monkeypatch, "llama", context_parallel=ContextParallelism.FLA_KERNELS)
    monkeypatch.setattr(device, "CUDA", False)
    with pytest.raises(ConfigError, match="runs context parallel with fla's CP kernels, which need NVIDIA GPUs"):
        check_context_parallel(config, cp_job)


def _build_on_gpu(monkeypatch, config_path: str, **overrides):
    monkeypatch.setattr(device, "CUDA", True)  # the warnings are for GPU runs
    config = load_model_config(config_path)
    for name, value in overrides.items():
        setattr(config, name, value)
    args = FlameModelArgs(config_path=config_path)
    args._config = config
    with torch.device("meta"):
        return build_model(args)


def test_gradient_spikes_and_rows_kept_whole_are_warned_at_build(monkeypatch, caplog):
    spikes = GradientSpikes("fused_recurrent", "a test cause", "a test remedy")
    record(monkeypatch, "gla", gradient_spikes=spikes, documents=Documents.ROWS_WHOLE, not_isolated_because="a test")
    _build_on_gpu(monkeypatch, GLA, attn_mode="fused_recurrent")
    assert "fla's gla with attn_mode fused_recurrent: a test cause; a test remedy" in caplog.text
    assert "fla's gla does not isolate packed documents (a test)" in caplog.text


def test_softmax_layers_are_counted_as_attention_flops(monkeypatch):
    model = _build_on_gpu(monkeypatch, GLA)
    assert model_flops(model).attention_widths == {}
    record(monkeypatch, "gla", softmax_layers=("GatedLinearAttention",))
    mixers = [block.attn for block in model.model.layers]
    assert model_flops(model).attention_widths == {None: sum(m.num_heads * m.head_k_dim for m in mixers)}
    assert "GatedLinearAttention" in support.softmax_attention_layers()


def test_compile_leaves_eager_the_blocks_of_types_whose_compiled_blocks_measured_slower_or_fail(monkeypatch, caplog):
    """--training.compile helps or does nothing: gla's blocks (compiled slower on GPUs) stay eager, with the
    measured reason in the log, as do kda's (not measured: fla's default, for the same reason) and rwkv7's (they
    fail to compile: the standard run's job file compiles, and trains it); llama's get compiled."""
    from torchtitan.distributed import ParallelDims

    from flame.distributed.parallelize import parallelize_model
    from flame.models.registry import decoder_layers, meta_model

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    reasons = {"gla": "(its compiled blocks trained 340M slower than eager (measured: docs/performance.md))",
               "kda": "(fla's token mixers run outside the compiled graph, and every fla type measured",
               "rwkv7": "(they do not compile: inductor fails on an in-place op on a view returned by fla's custom "
                        "autograd Function)"}
    for model_type, compiled in (("gla", False), ("kda", False), ("rwkv7", False), ("llama", True)):
        config_path = str(ROOT / "configs" / "tiny" / f"{model_type}.json")
        model = meta_model(load_model_config(config_path))  # torch.compile wraps lazily: nothing runs
        caplog.clear()
        with caplog.at_level("INFO"):
            parallelize_model(model, dims, job(monkeypatch, config_path, "--training.compile"))
        wrapped = [isinstance(block, torch._dynamo.eval_frame.OptimizedModule) for block in decoder_layers(model)]
        assert wrapped == [compiled] * len(wrapped), model_type
        if compiled:
            assert "stay eager" not in caplog.text and "Compiling each of the" in caplog.text
        else:
            assert f"--training.compile: fla's {model_type}'s decoder blocks stay eager {reasons[model_type]}" \
                in caplog.text, caplog.text


def test_memory_budget_ac_needs_compiled_blocks(monkeypatch):
    """The compiler chooses what compiled blocks recompute: without compile, or for a type whose blocks stay
    eager, memory_budget would do nothing, and is refused."""
    from torchtitan.distributed import ParallelDims

    from flame.distributed.parallelize import parallelize_model
    from flame.models.registry import meta_model

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    mamba2 = str(ROOT / "configs" / "tiny" / "mamba2.json")
    budget = "--activation_checkpoint.mode=memory_budget"
    for flags, refusal in (([budget], r"memory_budget needs --compile.enable \(--training.compile\)$"),
                           ([budget, "--training.compile"],
                            r"memory_budget needs compiled blocks, and fla's mamba2's stay eager \(its compiled blocks trained")):
        with pytest.raises(ConfigError, match=refusal):
            parallelize_model(meta_model(load_model_config(mamba2)), dims, job(monkeypatch, mamba2, *flags))

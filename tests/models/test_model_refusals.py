"""Bad model input is refused at preflight with one line that names the fix, before any process starts."""

import json

import pytest

from flame import compat
from flame.base.errors import ConfigError
from flame.models import load_model_config
from flame.prepare.model import ModelUnderCheck, check_model_options, check_position_table
from tests.conftest import ROOT, TINY_DECODER, base_args, parse_job, torchrun


def test_unknown_model_type_lists_types_and_custom_models(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ConfigError, match="custom_models/.*gated_deltanet.*llama"):
        load_model_config(str(path))


def test_gpu_attention_backend_on_cpu_is_refused(tmp_path, tiny_model, corpus):
    result = torchrun(base_args(tiny_model, corpus, tmp_path, steps=1) + ["--model.attention=varlen"])
    assert result.returncode != 0
    assert "--model.attention varlen runs CUDA kernels" in result.stdout + result.stderr


def preflight_error(tmp_path, capsys, model_config: dict, *flags: str) -> str:
    """train.sh's preflight on a model config: its exit code must be 2; returns the error line."""
    from flame.launch import preflight

    path = tmp_path / "model.json"
    path.write_text(json.dumps(model_config))
    args = [f"--model.config={path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", *flags]
    assert preflight.main(["--world-size", "1", "--", *args]) == 2
    return capsys.readouterr().err.strip()


def test_bad_model_input_is_refused_before_training(tmp_path, capsys):
    llama = {"model_type": "llama", **TINY_DECODER, "vocab_size": 4096}
    error = preflight_error(tmp_path, capsys, {**llama, "vocab_size": 4000})
    assert error == (
        "flame: error: model vocab_size 4000 is smaller than the tokenizer's 4096 tokens (builtin:python-stdlib-bpe): "
        "set vocab_size >= 4096 (a multiple of 64) in the model config"
    )
    error = preflight_error(tmp_path, capsys, {"model_type": "gemma2", **TINY_DECODER, "vocab_size": 4096, "head_dim": 16,
                                              "attn_logit_softcapping": 50.0})
    assert "attn_logit_softcapping needs eager/flash-attn attention" in error and "set it to null" in error
    error = preflight_error(tmp_path, capsys, {**llama, "attention_dropout": 0.1})
    assert "attention_dropout 0.1 is not supported" in error
    error = preflight_error(tmp_path, capsys, {"model_type": "llama_xl", "vocab_size": 4096})
    assert "unknown model_type 'llama_xl'" in error and "custom_models/" in error


def test_rows_or_documents_longer_than_a_learned_position_table_are_refused(tmp_path, capsys, monkeypatch):
    # GPT-2 indexes its wpe table by position (a device assert on GPUs past it); fla's cat raises in step 1
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 4096,
            "bos_token_id": 0, "eos_token_id": 0}
    error = preflight_error(tmp_path, capsys, gpt2, "--training.seq_len=256")
    assert error == (
        f"flame: error: gpt2 learns 128 positions (max_position_embeddings in {tmp_path / 'model.json'}), but this job "
        "gives it documents of up to 256 tokens; set --training.context_len to at most 128, or raise max_position_embeddings"
    )
    cat = {**json.loads((ROOT / "configs/tiny/cat.json").read_text()), "max_position_embeddings": 2048}
    error = preflight_error(tmp_path, capsys, cat, "--training.seq_len=4096", "--training.context_len=1024")
    assert "cat learns 2048 positions" in error and "sees each row whole) of up to 4096 tokens" in error
    assert "set --training.seq_len to at most 2048" in error

    def job(config: dict, *flags: str):
        path = tmp_path / "fits.json"
        path.write_text(json.dumps(config))
        return ModelUnderCheck.load(str(path)), parse_job(
            monkeypatch, 1, f"--model.config={path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
            "--training.dataset=builtin:python-stdlib", *flags)

    # positions restart at every document, so only context_len counts for GPT-2; rotary models have no table
    check_position_table(*job(gpt2, "--training.seq_len=1024", "--training.context_len=128"))
    check_position_table(*job({"model_type": "llama", **TINY_DECODER, "vocab_size": 4096, "max_position_embeddings": 64},
                              "--training.seq_len=256"))


def test_fla_models_are_refused_on_cpu_machines(monkeypatch):
    # fla's norms, activations and token mixers are Triton kernels: on CPU step 1 failed with a Triton traceback
    from flame.base import device

    config_path = ROOT / "configs/tiny/transformer.json"
    job = parse_job(monkeypatch, 1, f"--model.config={config_path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                    "--training.dataset=builtin:python-stdlib")
    monkeypatch.setattr(device, "CUDA", False)
    with pytest.raises(ConfigError) as error:
        check_model_options(ModelUnderCheck.load(str(config_path)), job)
    assert str(error.value).startswith("fla's transformer runs fla's Triton kernels") and "configs/llama_4M.json" in str(error.value)
    seed_job = parse_job(monkeypatch, 1, f"--model.config={config_path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                         "--training.dataset=builtin:python-stdlib", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    check_model_options(ModelUnderCheck.load(str(config_path)), seed_job)  # initial weights only: no kernel runs
    monkeypatch.setattr(device, "CUDA", True)
    check_model_options(ModelUnderCheck.load(str(config_path)), job)


@pytest.mark.parametrize("model_type, module, install", [
    ("mamba3", "mamba_ssm", "pip install --no-build-isolation --no-deps mamba-ssm==2.3.2.post1"),
])
def test_fla_models_that_need_a_missing_package_are_refused(monkeypatch, model_type, module, install):
    # without the package, mamba3 raises inside step 1 (moba's flash-attn calls flame provides)
    import importlib.util

    from flame.base import device

    config_path = ROOT / f"configs/tiny/{model_type}.json"
    model_config = load_model_config(str(config_path))
    job = parse_job(monkeypatch, 1, f"--model.config={config_path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                    "--training.dataset=builtin:python-stdlib")
    monkeypatch.setattr(device, "CUDA", True)
    find_spec = importlib.util.find_spec
    for installed in (False, True):
        def fake_find_spec(name, *args, installed=installed):
            return (object() if installed else None) if name == module else find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
        if installed:
            check_model_options(ModelUnderCheck(model_config), job)
            continue
        with pytest.raises(ConfigError) as error:
            check_model_options(ModelUnderCheck(model_config), job)
        assert str(error.value).startswith(f"fla's {model_type} needs ") and f"{install} (not installed here)" in str(error.value)


@pytest.mark.parametrize("model_type, option, module, package, settings", [
    ("moba", "use_flash_moba", "flash_moba", "flash-moba", {}),
    ("mamba3", "is_mimo", "tilelang", "tilelang", {"chunk_size": 16}),  # what MIMO's kernels need (test_mamba3_kernels)
])
def test_fla_options_that_need_a_missing_package_are_refused(monkeypatch, model_type, option, module, package, settings):
    # without it fla raises while building the model, in every process
    import importlib.util

    from flame.base import device

    config_path = ROOT / f"configs/tiny/{model_type}.json"
    job = parse_job(monkeypatch, 1, f"--model.config={config_path}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                    "--training.dataset=builtin:python-stdlib")
    monkeypatch.setattr(device, "CUDA", True)
    find_spec = importlib.util.find_spec
    missing = {module}  # only the option's package: mamba3's own counts as installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name in missing else object() if name in {module, "mamba_ssm"} else find_spec(name, *args)))
    config = load_model_config(str(config_path))
    check_model_options(ModelUnderCheck(config), job)  # the option off: nothing missing
    for name, value in {option: True, **settings}.items():
        setattr(config, name, value)
    with pytest.raises(ConfigError) as error:
        check_model_options(ModelUnderCheck(config), job)
    assert str(error.value).startswith(f"fla's {model_type} with {option} true needs ")
    assert str(error.value).endswith(f": pip install {package} (not installed here), or set {option} to false in the model config")
    missing.clear()
    # as if the kernels had imported with the package there (mamba3's MIMO kernels failed to import without it)
    monkeypatch.setattr(compat.mamba_ssm, "mamba3_kernel_errors", {})
    check_model_options(ModelUnderCheck(config), job)


@pytest.mark.parametrize(
    "world_size, flags, reason",
    [
        (1, ["--training.mixed_precision_param=float32"], "(--training.mixed_precision_param float32)"),
        (2, ["--parallelism.tensor_parallel_degree=2"], "(tensor/pipeline parallelism without FSDP"),
        (2, ["--parallelism.pipeline_parallel_degree=2"], "(tensor/pipeline parallelism without FSDP"),
    ],
)
def test_fla_kernels_that_refuse_float32_are_refused_in_float32_jobs(monkeypatch, world_size, flags, reason):
    # on GPUs: delta_net's chunk kernel asserts on float32 inputs inside every rank's first step
    from flame.base import device

    monkeypatch.setattr(device, "CUDA", True)
    config_path = ROOT / "configs/tiny/delta_net.json"
    model_config = load_model_config(str(config_path))

    def job(world: int, *args: str):
        return parse_job(monkeypatch, world, f"--model.config={config_path}",
                         "--model.tokenizer_path=builtin:python-stdlib-bpe", "--training.dataset=builtin:python-stdlib", *args)

    float32_job = job(world_size, *flags)
    with pytest.raises(ConfigError) as error:
        check_model_options(ModelUnderCheck(model_config), float32_job)
    assert str(error.value).startswith("fla's delta_net kernel (chunk_delta_rule) refuses float32, but this job computes")
    assert reason in str(error.value) and "data_parallel_shard_degree > 1" in str(error.value)
    # bf16 mixed precision: one GPU (autocast), FSDP 2 x TP 2 and PP 2 x FSDP 2 (FSDP casts the weights)
    check_model_options(ModelUnderCheck(model_config), job(1))
    check_model_options(ModelUnderCheck(model_config), job(4, "--parallelism.tensor_parallel_degree=2"))
    check_model_options(ModelUnderCheck(model_config), job(4, "--parallelism.pipeline_parallel_degree=2"))


@pytest.mark.parametrize("refused_by_fla, refused", [(True, True), (False, False)])
def test_types_whose_hopper_backward_needs_tilelang_are_refused_without_it(monkeypatch, refused_by_fla, refused):
    import importlib.util

    from flame import compat
    from flame.models.support import support_for
    from flame.prepare.model import check_tilelang_on_hopper

    # fla's own test: a Hopper GPU with Triton 3.4 to 3.7.0
    monkeypatch.setattr(compat.fla, "gated_chunk_backward_refused", lambda: refused_by_fla)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tilelang" else find_spec(name, *a))
    support = support_for("gated_deltanet")
    assert support.tilelang_on_hopper and support_for("gla").tilelang_on_hopper is False
    if refused:
        with pytest.raises(ConfigError, match="fla's gated_deltanet trains on Hopper GPUs with Triton .* only through "
                                              "TileLang .* pip install flame\\[gpu\\]"):
            check_tilelang_on_hopper(support)
    else:
        check_tilelang_on_hopper(support)

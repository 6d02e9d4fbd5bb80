"""--model.init_from: a run starts from a Hugging Face model's weights in one command, on one process and
under FSDP, with LoRA too; a resumed run reads its own checkpoint; bad folders are one-line errors.

The HF models are made here: a tiny llama with tied embeddings saved in bfloat16 (the run trains
in float32) with its tokenizer, and custom_models' example model.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from flame.launch import preflight
from tests.conftest import (
    ROOT,
    SCRIPTS,
    TINY_DECODER,
    TOKENIZER,
    assert_same_curve,
    check,
    metrics,
    parse_job,
    torchrun,
    two_at_a_time,
    write_job_toml,
)
from tests.checkpoint.test_export import convert

EXAMPLE_CONFIG = ROOT / "custom_models" / "example_lm" / "config_tiny.json"
LOSS = "loss_metrics/global_avg_loss"


def run_args(dump: Path, steps: int, batch_size: int, *flags: str, checkpoints: bool = True) -> list[str]:
    """4 rows of 64 tokens per step (``batch_size`` 4 in one process, 2 on each of 2 FSDP ranks); no model flags."""
    # causal attention over whole rows (no document mask), which the HF model computes alike
    return [
        "--training.dataset=builtin:python-stdlib", "--training.seq_len=64", f"--training.batch_size={batch_size}",
        "--training.no-document_mask", f"--training.steps={steps}", "--optimizer.lr=3e-3", "--lr_scheduler.warmup_steps=2",
        "--metrics.log_freq=1", f"--job.dump_folder={dump}", *flags,
        *(["--checkpoint.enable", "--checkpoint.interval=2"] if checkpoints else []),
    ]


def save_hf_models(root: Path) -> SimpleNamespace:
    from flame.data.tokenizer import load_tokenizer
    from flame.models import load_model_config

    config = root / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_DECODER, "max_position_embeddings": 512,
                                  "vocab_size": 4096, "tie_word_embeddings": True}))
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(load_model_config(str(config)))
    llama.to(torch.bfloat16).save_pretrained(root / "llama")
    load_tokenizer(TOKENIZER).save_pretrained(root / "llama")  # the tokenizer defaults to the folder's
    example = AutoModelForCausalLM.from_config(load_model_config(str(EXAMPLE_CONFIG)))
    example.save_pretrained(root / "example", max_shard_size="400KB")  # sharded: several safetensors files
    return SimpleNamespace(llama=root / "llama", example=root / "example")


def hf_loss(out: Path) -> float:
    return json.loads(out.read_text())["hf_loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    """4 steps of the llama in one process (against the HF model's own step-1 loss), then a resume from its
    step 2; 2 steps of the llama with LoRA under FSDP 2; 1 step of the example model, without checkpoints, in
    one process and under FSDP 2."""
    root = tmp_path_factory.mktemp("init_from")
    hf = save_hf_models(root)
    parity = str(SCRIPTS / "init_from_parity.py")
    single, resumed, fsdp = root / "single", root / "resumed", root / "fsdp"
    example, example_fsdp = root / "example_run", root / "example_fsdp"

    def single_then_resumed():
        check(torchrun([str(root / "single.json"), f"--model.init_from={hf.llama}", *run_args(single, 4, 4)],
                       module=parity))
        # the run's own step 2 in a folder of its own: the same command resumes from it, not from init_from
        shutil.copytree(single / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
        return check(torchrun([f"--model.init_from={hf.llama}", *run_args(resumed, 4, 4)]))

    def fsdp_then_example():
        fsdp_result = check(torchrun([f"--model.init_from={hf.llama}", *run_args(fsdp, 2, 2, "--lora.rank=4")], nproc=2))
        check(torchrun([str(root / "example.json"), f"--model.init_from={hf.example}",
                        f"--model.tokenizer_path={TOKENIZER}", *run_args(example, 1, 4, checkpoints=False)],
                       module=parity))
        check(torchrun([f"--model.init_from={hf.example}", f"--model.tokenizer_path={TOKENIZER}",
                        *run_args(example_fsdp, 1, 2, checkpoints=False)], nproc=2))
        return fsdp_result

    resumed_result, fsdp_result = two_at_a_time(single_then_resumed, fsdp_then_example)
    return SimpleNamespace(hf=hf, single=single, resumed=resumed, fsdp=fsdp, example=example, example_fsdp=example_fsdp,
                           single_hf_loss=hf_loss(root / "single.json"), example_hf_loss=hf_loss(root / "example.json"),
                           resumed_log=resumed_result.stdout + resumed_result.stderr,
                           fsdp_log=fsdp_result.stdout + fsdp_result.stderr)


def test_the_first_step_computes_the_hf_models_own_loss(runs):
    # bfloat16 files, tied embeddings, rotary frequencies (non-persistent buffers): all as transformers loads them
    assert metrics(runs.single)[1][LOSS] == pytest.approx(runs.single_hf_loss, rel=1e-5)
    assert len(list(runs.hf.example.glob("*.safetensors"))) > 1  # read from several files
    assert metrics(runs.example)[1][LOSS] == pytest.approx(runs.example_hf_loss, rel=1e-5)
    # the custom model's weights loaded into FSDP's shards on 2 ranks: the same rows, the same loss
    assert metrics(runs.example_fsdp)[1][LOSS] == pytest.approx(runs.example_hf_loss, rel=1e-5)
    single = metrics(runs.single)
    assert single[4][LOSS] < single[1][LOSS]  # and it trains from there


def test_fsdp_with_lora_starts_from_the_hf_weights(runs, tmp_path):
    # LoRA's adapters start as zero updates, so FSDP's step 1 computes the HF model's loss as well
    fsdp = metrics(runs.fsdp)
    assert sorted(fsdp) == [1, 2]
    assert fsdp[1][LOSS] == pytest.approx(runs.single_hf_loss, rel=1e-5)
    assert "LoRA: a model-only load reads the base weights" in runs.fsdp_log
    assert "--model.init_from: loading the weights of" in runs.fsdp_log
    # the exported adapter names the weights it was trained over
    convert("flame.utils.convert_dcp_to_hf", "--path", str(runs.fsdp), "--out", str(tmp_path / "adapter"))
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(runs.hf.llama)


def test_a_resumed_run_reads_its_own_checkpoint_not_init_from(runs):
    assert "--model.init_from" in runs.resumed_log and "is not applied: this run resumes from its own checkpoint" in runs.resumed_log
    assert "loading the weights of" not in runs.resumed_log
    resumed = metrics(runs.resumed)
    assert sorted(resumed) == [3, 4]
    assert_same_curve(resumed, metrics(runs.single), rel=1e-6, steps=[3, 4])


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    return save_hf_models(tmp_path_factory.mktemp("hf")).llama


def _config(folder: Path, **changes) -> str:
    config = json.loads((folder / "config.json").read_text()) | changes
    path = folder.parent / f"changed_{len(changes)}_{'_'.join(map(str, changes.values()))}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "--model.init_from {missing} does not exist; give a Hugging Face model folder"),
        ("hub", "--model.init_from flame-tests/not-a-cached-model is neither a folder nor a hub name in the local HF cache"),
        ("no_weights", "--model.init_from {empty} holds no .safetensors weights"),
        ("adapter", "--model.init_from {adapter} holds a LoRA adapter, not a whole model; give its base model"),
        ("cut_short", "--model.init_from {cut_short}: cannot read its safetensors files"),
        ("untied", "does not fit --model.config {untied}: it has no lm_head.weight; drop --model.config"),
        ("shapes", "model.layers.0.mlp.gate_proj.weight is [128, 64] there, [96, 64] in the model"),
        ("model_type", "holds a llama model, but --model.config {example} is flame_example_lm; drop --model.config"),
        ("seed", "--model.init_from and --checkpoint.create_seed_checkpoint both give the run its starting weights"),
    ],
)
def test_bad_init_from_is_a_one_line_error_that_writes_nothing(tmp_path, capsys, monkeypatch, hf_llama, case, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((hf_llama / "config.json").read_text())
    adapter, cut_short = tmp_path / "adapter", tmp_path / "cut_short"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    shutil.copytree(hf_llama, cut_short)
    with open(cut_short / "model.safetensors", "r+b") as f:
        f.truncate(1000)  # a copy that stopped early
    paths = {"missing": str(tmp_path / "missing"), "empty": str(empty), "example": str(EXAMPLE_CONFIG),
             "adapter": str(adapter), "cut_short": str(cut_short),
             "untied": _config(hf_llama, tie_word_embeddings=False), "shapes": _config(hf_llama, intermediate_size=96)}
    flags = {
        "missing": [f"--model.init_from={paths['missing']}"],
        "hub": ["--model.init_from=flame-tests/not-a-cached-model"],
        "no_weights": [f"--model.init_from={empty}"],
        "adapter": [f"--model.init_from={adapter}"],
        "cut_short": [f"--model.init_from={cut_short}"],
        "untied": [f"--model.init_from={hf_llama}", f"--model.config={paths['untied']}"],
        "shapes": [f"--model.init_from={hf_llama}", f"--model.config={paths['shapes']}"],
        "model_type": [f"--model.init_from={hf_llama}", f"--model.config={EXAMPLE_CONFIG}"],
        "seed": [f"--model.init_from={hf_llama}", "--checkpoint.create_seed_checkpoint"],
    }[case]
    dump = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [*flags, f"--model.tokenizer_path={TOKENIZER}", "--training.dataset=builtin:python-stdlib",
            "--training.seq_len=64", "--checkpoint.enable", f"--job.dump_folder={dump}"]
    assert preflight.main(["--world-size", "1", "--", *args]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("flame: error: ") and "\n" not in error
    assert message.format(**paths) in error
    assert not dump.exists()


def test_a_tied_model_needs_one_name_of_its_tied_weights_stored():
    from flame.models import init_from, load_model_config
    from flame.models.registry import meta_model

    model = meta_model(load_model_config(str(EXAMPLE_CONFIG)))
    stored = {name: list(tensor.shape) for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    assert init_from.mismatches(model, stored) == []
    extra = stored | {"model.layers.9.mlp.up_proj.weight": [176, 64]}
    assert init_from.mismatches(model, extra) == ["the model has no model.layers.9.mlp.up_proj.weight"]
    assert init_from.mismatches(model, {}) [0] == "it has no model.embed_tokens.weight"


def test_an_fla_model_folder_fits_its_own_config(tmp_path):
    from flame.models import init_from, load_model_config
    from flame.models.registry import meta_model

    config = load_model_config(str(ROOT / "configs" / "tiny" / "gla.json"))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gla")
    folder = init_from.resolve(str(tmp_path / "gla"))
    init_from.check_fits(folder, folder, meta_model(load_model_config(folder)))  # fla's names are its files' names


def test_init_from_on_the_command_line_replaces_the_job_files_model(tmp_path, monkeypatch, hf_llama, tiny_model):
    # a job TOML's model config and tokenizer are its template's; a --model.config on the command line stays
    toml = write_job_toml(tmp_path / "job.toml", tiny_model, "seq_len = 64")
    job = parse_job(monkeypatch, 1, f"--job.config_file={toml}", f"--model.init_from={hf_llama}")
    assert (job.model.config, job.model.tokenizer_path) == (str(hf_llama), str(hf_llama))
    job = parse_job(monkeypatch, 1, f"--job.config_file={toml}", f"--model.init_from={hf_llama}", f"--model.config={tiny_model}")
    assert (job.model.config, job.model.tokenizer_path) == (tiny_model, str(hf_llama))

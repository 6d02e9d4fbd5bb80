"""Checkpoints come out as Hugging Face models, and HF models go in as checkpoints."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ROOT, TOKENIZER, base_args, check, flame_env, torchrun


def convert(module: str, *args: str) -> None:
    """A converter's command line, in this process: it needs no process group, and a process of its own
    would spend seconds importing torch again (test_hf_to_dcp_converts_an_fla_model needs a fresh one)."""
    assert importlib.import_module(module).main(list(args)) == 0


def test_export_reproduces_the_trained_models_logits(tmp_path, tiny_model, corpus):
    dump, logits_file = tmp_path / "run", tmp_path / "logits.pt"
    os.environ["FLAME_TEST_LOGITS"] = str(logits_file)
    try:
        check(torchrun(base_args(tiny_model, corpus, dump, steps=5), nproc=2,
                       module=str(ROOT / "tests" / "scripts" / "train_and_save_logits.py")))
    finally:
        del os.environ["FLAME_TEST_LOGITS"]
    convert("flame.utils.convert_dcp_to_hf", "--path", str(dump))

    exported = dump / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (exported / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(exported)
    expected = torch.load(logits_file)
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, tiny_model, corpus):
    """A 2-step run whose config asks for bfloat16 exports (shared by the tests below)."""
    dump = tmp_path_factory.mktemp("export") / "run"
    check(torchrun(base_args(tiny_model, corpus, dump, steps=2) + ["--checkpoint.export_dtype=bfloat16"]))
    return dump


def test_export_dtype_is_honoured(bf16_run):
    dump = bf16_run
    convert("flame.utils.convert_dcp_to_hf", "--path", str(dump))
    with safe_open(dump / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(key).dtype for key in f.keys()} == {torch.bfloat16}
    assert json.loads((dump / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_export_imports_no_torchtitan():
    # torchtitan's import takes seconds, and the export that ends every train.sh run needs none of it
    code = "import sys, flame.checkpoint.export; print(sorted(m for m in sys.modules if m.startswith('torchtitan')))"
    result = check(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=flame_env(), capture_output=True, text=True,
                                  timeout=300))
    assert result.stdout.split("\n")[-2] == "[]"


def test_hf_to_dcp_to_training_to_hf_round_trip(tmp_path, tiny_model, corpus):
    from flame.data.tokenizer import load_tokenizer
    from flame.models import load_model_config

    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(load_model_config(tiny_model))
    hf_in, dump = tmp_path / "hf_in", tmp_path / "run"
    original.save_pretrained(hf_in)
    load_tokenizer(TOKENIZER).save_pretrained(hf_in)

    convert("flame.utils.convert_hf_to_dcp", "--model", str(hf_in), "--checkpoint", str(dump / "checkpoint" / "step-0"))
    # one step at learning rate 0: flame loads the step-0 weights and saves them unchanged
    args = base_args(str(hf_in), corpus, dump, steps=1) + ["--optimizer.lr=0", "--model.tokenizer_path", str(hf_in)]
    result = check(torchrun(args))
    assert "Loading the checkpoint from" in result.stdout + result.stderr
    convert("flame.utils.convert_dcp_to_hf", "--path", str(dump), "--step", "1", "--out", str(tmp_path / "hf_out"))

    roundtrip = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    for (name, a), (_, b) in zip(original.state_dict().items(), roundtrip.state_dict().items()):
        assert torch.equal(a, b), name
    input_ids = torch.randint(0, 4096, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(roundtrip(input_ids).logits, original(input_ids).logits, rtol=0, atol=0)


def test_hf_to_dcp_converts_an_fla_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    from flame.models import load_model_config

    model = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs" / "tiny" / "gla.json")))
    model.save_pretrained(tmp_path / "hf_in")
    # a fresh process, which imports fla only because the model directory holds an fla model
    check(subprocess.run([sys.executable, "-m", "flame.utils.convert_hf_to_dcp", "--model", str(tmp_path / "hf_in"),
                          "--checkpoint", str(tmp_path / "dcp")], cwd=ROOT, env=flame_env(), capture_output=True, text=True,
                         check=False))
    saved = dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    assert saved.keys() == model.state_dict().keys()


def test_hf_to_dcp_refuses_to_overwrite(tmp_path):
    target = tmp_path / "step-0"
    target.mkdir()
    (target / "keep").write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "flame.utils.convert_hf_to_dcp", "--model", "unused", "--checkpoint", str(target)],
        cwd=ROOT, env=flame_env(), capture_output=True, text=True,
    )
    assert result.returncode == 2 and "not empty" in result.stderr
    assert (target / "keep").read_text() == "x"


def test_dcp_to_hf_names_missing_steps(bf16_run):
    result = subprocess.run(
        [sys.executable, "-m", "flame.utils.convert_dcp_to_hf", "--path", str(bf16_run), "--step", "7"],
        cwd=ROOT, env=flame_env(), capture_output=True, text=True,
    )
    assert result.returncode == 2 and "no complete checkpoint for step 7" in result.stderr and "[2]" in result.stderr


def test_large_models_export_as_sharded_safetensors(tmp_path, bf16_run):
    out = tmp_path / "hf_sharded"
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run), "--max_shard_size", "150KB", "--out", str(out))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    AutoModelForCausalLM.from_pretrained(out)


def export_status(*args: str) -> int:
    from flame.checkpoint.export import main

    return main(list(args))


def test_an_export_never_replaces_a_folder_flame_did_not_make(tmp_path, bf16_run, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert export_status("--path", str(bf16_run), "--out", str(mine)) == 2
    assert f"--out {mine} exists and is not an export flame wrote (it holds notes.txt)" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "a_file").write_text("x")
    assert export_status("--path", str(bf16_run), "--out", str(tmp_path / "a_file")) == 2
    assert "is a file, and an export is a folder" in capsys.readouterr().err


def test_an_export_replaces_an_empty_folder_an_earlier_export_and_the_folder_a_link_names(tmp_path, bf16_run):
    out = tmp_path / "out"
    out.mkdir()
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run), "--out", str(out))  # empty: taken
    assert (out / ".flame_export").is_file() and (out / "config.json").is_file()
    (out / "config.json").write_text("{}")  # an earlier export, changed since: replaced whole
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run), "--out", str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    link = tmp_path / "link"
    link.symlink_to(out)
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run), "--out", str(link))
    assert link.is_symlink() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_an_earlier_flames_export_in_the_run_folder_is_replaced(tmp_path, bf16_run):
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run))
    (bf16_run / "hf" / ".flame_export").unlink()  # as flame wrote exports before it marked them
    convert("flame.utils.convert_dcp_to_hf", "--path", str(bf16_run))
    assert (bf16_run / "hf" / ".flame_export").is_file()

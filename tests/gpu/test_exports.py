"""fla exports on a GPU, loaded as users load them: forward and generate after ``flame.register()`` (no
flash-attn), fla's transformer exported as llama giving fla's own logits and generations, and the Mamba
family's exports giving the logits and generations of the fla model they came from."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import flame
from flame.models import load_model_config
from flame.checkpoint import export, import_hf
from tests.conftest import ROOT, SCRIPTS, TOKENIZER, check, flame_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def exports(tmp_path, model_type: str, *formats: str) -> dict[str, str]:
    """A tiny fla model of ``model_type`` with random weights, through a flame checkpoint, exported in ``formats``."""
    flame.register()
    config = str(ROOT / "configs" / "tiny" / f"{model_type}.json")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(config))
    with torch.no_grad():  # decisive logits: greedy choices that rounding cannot flip
        model.lm_head.weight.mul_(30)
    model.save_pretrained(tmp_path / "hf_in")
    dump = tmp_path / "run"
    assert import_hf.main(["--model", str(tmp_path / "hf_in"), "--checkpoint", str(dump / "checkpoint" / "step-0")]) == 0
    out = {}
    for name in formats:
        out[name] = str(tmp_path / name)
        assert export.main(["--path", str(dump), "--step", "0", "--config", config, "--tokenizer", TOKENIZER,
                                       "--export_as", name, "--out", out[name]]) == 0
    return out


def load_and_generate(*entries: str, saved) -> dict:
    """tests/scripts/load_exports.py on the GPU, in a fresh process: its report; the logits and ids in ``saved``."""
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "load_exports.py"), "--device", "cuda", "--save",
                                   str(saved), *entries], cwd=ROOT, env=flame_env(), capture_output=True, text=True))
    return json.loads(result.stdout.splitlines()[-1])


def test_fla_transformer_exports_natively_and_as_llama_with_the_same_logits_and_generations(tmp_path):
    paths = exports(tmp_path, "transformer", "native", "llama")
    report = load_and_generate(f"{paths['native']}:padded", f"{paths['llama']}:padded", saved=tmp_path / "out.pt")
    assert report[paths["native"]]["class"] == "TransformerForCausalLM"
    assert report[paths["llama"]]["class"] == "LlamaForCausalLM"
    out = torch.load(tmp_path / "out.pt")
    native, llama = out[paths["native"]], out[paths["llama"]]
    torch.testing.assert_close(llama["logits"], native["logits"], rtol=1e-4, atol=1e-3)
    assert torch.equal(llama["generated"], native["generated"])


def test_gla_export_runs_forward_and_generate(tmp_path):
    paths = exports(tmp_path, "gla", "native")
    report = load_and_generate(f"{paths['native']}:run", saved=tmp_path / "out.pt")
    assert report[paths["native"]]["class"] == "GLAForCausalLM"
    assert torch.load(tmp_path / "out.pt")[paths["native"]]["logits"].isfinite().all()


@pytest.mark.parametrize("model_type, fla_class", [("mamba", "MambaForCausalLM"), ("samba", "SambaForCausalLM"),
                                                   ("mamba2", "Mamba2ForCausalLM")])
def test_mamba_family_exports_give_the_logits_and_generations_of_the_fla_model_they_came_from(tmp_path, model_type,
                                                                                                fla_class):
    """Through a flame checkpoint and the export: fla's class, and the logits of the fla model saved before
    (flame's Mamba scans in the forward; generation with fla's cache, which must choose what full forwards do)."""
    paths = exports(tmp_path, model_type, "native")
    source = str(tmp_path / "hf_in")
    report = load_and_generate(f"{source}:run", f"{paths['native']}:run", saved=tmp_path / "out.pt")
    assert report[paths["native"]]["class"] == fla_class
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out[paths["native"]]["logits"], out[source]["logits"], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[paths["native"]]["generated"], out[source]["generated"])

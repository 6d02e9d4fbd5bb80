"""The default HF export (--checkpoint.export_as auto) loads where transformers and fla are and flame and flash-attn
are not, with flame's weights and logits: fla's transformer as llama, gla and llama under their own architectures."""

import json
import subprocess
import sys
import sysconfig

import pytest
import torch
from transformers import AutoModelForCausalLM

import flame
from flame.checkpoint import llama_export
from flame.checkpoint.export import load_hf_model_from_dcp
from flame.config.job import Checkpoint
from flame.models import load_model_config
from tests.checkpoint.test_export_formats import FLA_TRANSFORMER, fla_transformer_reference
from tests.conftest import ROOT, TOKENIZER, check

# In the child: no flame (asserted), no flash-attn (asserted), fla imported as a user without flame has it.
# Each DIR[:run] loads with AutoModelForCausalLM; ``run`` also computes the logits of the saved ids (fla's
# Triton kernels need a GPU: on CPU the gla export is only loaded, and its weights compared).
LOADER = """
import importlib.util, sys
import torch
assert importlib.util.find_spec("flame") is None, "flame is importable: the test cannot show an export loads without it"
assert importlib.util.find_spec("flash_attn") is None, "flash-attn is installed: the test cannot show an export needs none"
import fla  # registers fla's types with transformers
from transformers import AutoModelForCausalLM

ids, out = torch.load(sys.argv[1]), {}
for entry in sys.argv[3:]:
    path, _, mode = entry.partition(":")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out[path] = {"class": type(model).__name__, "weights": model.state_dict()}
    if mode == "run":
        with torch.no_grad():
            out[path]["logits"] = model(ids).logits
torch.save(out, sys.argv[2])
"""


def convert(module: str, *args: str) -> int:
    import importlib

    return importlib.import_module(module).main(list(args))


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, dict]:
    """Per model type: a tiny model's weights as a step-0 checkpoint (as a run saves them), exported with the default
    format by ``flame export``; its config, checkpoint, export folder, the export's log line and the model's weights."""
    root = tmp_path_factory.mktemp("default_exports")
    flame.register()  # fla's transformer builds only with flame's stand-ins for flash-attn
    made = {}
    for name, config in (("transformer", FLA_TRANSFORMER),
                         ("gla", json.loads((ROOT / "configs" / "tiny" / "gla.json").read_text())),
                         ("llama", json.loads((ROOT / "configs" / "tiny" / "llama.json").read_text()))):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(load_model_config(str(folder / "config.json")))
        with torch.no_grad():  # norms away from 1 and biases away from 0, so that a weight put in the wrong place shows
            for parameter in model.parameters():
                parameter.normal_(0.0 if parameter.ndim > 1 else 1.0, 0.2)
        model.save_pretrained(folder / "hf")
        checkpoint = folder / "dump" / "checkpoint" / "step-0"
        assert convert("flame.utils.convert_hf_to_dcp", "--model", str(folder / "hf"), "--checkpoint", str(checkpoint)) == 0
        out = folder / "export"
        result = check(subprocess.run(
            [sys.executable, "-m", "flame.checkpoint.export", str(folder / "dump"), "--step", "0", "--config",
             str(folder / "config.json"), "--tokenizer", TOKENIZER, "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True))
        made[name] = {"config": folder / "config.json", "checkpoint": checkpoint, "out": out,
                      "log": result.stdout.strip().splitlines()[-1], "weights": model.state_dict()}
    return made


def test_the_default_format_is_auto():
    assert Checkpoint().export_as == "auto" and "auto" in llama_export.FORMATS


def test_every_default_export_loads_without_flame_or_flash_attn_with_flames_logits(exports, tmp_path):
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    site_packages = sysconfig.get_paths()["purelib"]
    # -S: no .pth files, so neither flame's editable finder nor this checkout is on the path; site-packages is
    env = {"PYTHONPATH": site_packages, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    check(subprocess.run(
        [sys.executable, "-S", "-c", LOADER, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
         f"{exports['transformer']['out']}:run", f"{exports['llama']['out']}:run", str(exports["gla"]["out"])],
        cwd=tmp_path, env=env, capture_output=True, text=True))
    loaded = torch.load(tmp_path / "out.pt")
    transformer, gla, llama = (loaded[str(exports[name]["out"])] for name in ("transformer", "gla", "llama"))

    assert transformer["class"] == "LlamaForCausalLM"
    torch.testing.assert_close(transformer["logits"], fla_transformer_reference(exports["transformer"]["weights"], ids),
                               rtol=1e-5, atol=1e-5)

    assert gla["class"] == "GLAForCausalLM"
    assert gla["weights"].keys() == exports["gla"]["weights"].keys()
    for name, tensor in exports["gla"]["weights"].items():
        torch.testing.assert_close(gla["weights"][name], tensor, rtol=0, atol=0, msg=name)

    assert llama["class"] == "LlamaForCausalLM"
    flames = load_hf_model_from_dcp(str(exports["llama"]["checkpoint"]), load_model_config(str(exports["llama"]["config"])),
                                    runnable=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(llama["logits"], flames(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_log_and_the_card_say_which_format_and_why(exports):
    transformer, gla = exports["transformer"], exports["gla"]
    assert " as llama (float32): --checkpoint.export_as auto: llama, which loads in plain transformers; its own " \
           "architecture loads only with flash-attn or after flame.register() (fla's Attention)" in transformer["log"]
    assert json.loads((transformer["out"] / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "Exported format: --checkpoint.export_as auto: llama, which loads" in (transformer["out"] / "README.md").read_text()
    assert gla["log"].endswith("(float32): --checkpoint.export_as auto: its own architecture, which loads without flash-attn")
    assert "Exported format: --checkpoint.export_as auto: its own architecture" in (gla["out"] / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(path.stem for path in (ROOT / "configs" / "tiny").glob("*.json")))
def test_auto_exports_as_llama_only_what_needs_flash_attn_and_llama_expresses(name):
    config = load_model_config(str(ROOT / "configs" / "tiny" / f"{name}.json"))
    chosen, why = llama_export.choose(config, "auto", "--checkpoint.export_as")
    assert chosen == ("llama" if name == "transformer" else "native"), why
    needs_flash_attn = name in ("bitnet", "deltaformer", "mla", "moba", "nsa", "rodimus", "samba", "transformer")
    assert ("loads only with flash-attn" in why) == needs_flash_attn, why


def test_auto_keeps_the_own_architecture_where_llama_cannot_express_it_or_for_an_adapter():
    config = load_model_config(str(ROOT / "configs" / "tiny" / "transformer.json"))
    chosen, why = llama_export.choose(config, "auto", "--checkpoint.export_as", adapter=True)
    assert chosen == "native" and "a LoRA adapter keeps its base model's architecture" in why
    config.qk_norm = True
    chosen, why = llama_export.choose(config, "auto", "--checkpoint.export_as")
    assert chosen == "native" and why.endswith("llama cannot express it (this transformer sets qk_norm True, and llama "
                                               "has no norms of queries and keys)")
    gla = load_model_config(str(ROOT / "configs" / "tiny" / "gla.json"))
    gla.attn = {"layers": [1], "num_heads": 2}  # a hybrid: its attention layer is fla's Attention
    chosen, why = llama_export.choose(gla, "auto", "--checkpoint.export_as")
    assert chosen == "native" and "(fla's Attention with attn)" in why
    assert llama_export.choose(gla, "native", "--export_as") == (
        "native", "--export_as native: its own architecture, which loads only with flash-attn or after "
                  "flame.register() (fla's Attention with attn)")

"""On a GPU: the default HF exports (--checkpoint.export_as auto) of fla's types load where transformers and fla are and
flame and flash-attn are not, and compute flame's logits there (fla's kernels run on a GPU only: the CPU test,
tests/checkpoint/test_export_default_loads.py, compares gla's weights alone)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import flame
from tests.checkpoint.test_export_default_loads import exports  # noqa: F401  (the module's fixture)
from tests.conftest import ROOT, check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a GPU")

LOADER = """
import importlib.util, sys
import torch
assert importlib.util.find_spec("flame") is None, "flame is importable: the test cannot show an export loads without it"
assert importlib.util.find_spec("flash_attn") is None, "flash-attn is installed: the test cannot show an export needs none"
import fla  # registers fla's types with transformers
from transformers import AutoModelForCausalLM

ids, out = torch.load(sys.argv[1]).cuda(), {}
for path in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out[path] = {"class": type(model).__name__, "logits": model(ids).logits.cpu()}
torch.save(out, sys.argv[2])
"""


def test_fla_exports_load_without_flame_and_give_flames_logits(exports, tmp_path):  # noqa: F811
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    # every entry of this interpreter's path but the checkout: -S leaves out the .pth files (flame's editable finder)
    path = [entry for entry in sys.path if entry and Path(entry).is_dir() and not Path(entry).samefile(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    names = ("transformer", "gla")
    check(subprocess.run([sys.executable, "-S", "-c", LOADER, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
                          *(str(exports[name]["out"]) for name in names)], cwd=tmp_path, env=env, capture_output=True,
                         text=True))
    loaded = torch.load(tmp_path / "out.pt")
    flame.register()  # flame's own models: the weights the exports were made from, under their own architectures
    for name in names:
        reference = AutoModelForCausalLM.from_pretrained(exports[name]["out"].parent / "hf", dtype=torch.float32)
        with torch.no_grad():
            expected = reference.cuda().eval()(ids.cuda()).logits.cpu()
        got = loaded[str(exports[name]["out"])]
        assert got["class"] == ("LlamaForCausalLM" if name == "transformer" else "GLAForCausalLM")
        torch.testing.assert_close(got["logits"], expected, rtol=2e-3, atol=2e-3, msg=name)

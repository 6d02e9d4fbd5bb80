"""The example user architecture (custom_models/example_lm) registers, masks documents, trains and exports."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.models.kernels import attention
from flame.models import load_model_config
from flame.checkpoint import export
from tests.conftest import ROOT, SCRIPTS, base_args, check, flame_env, losses, torchrun

CONFIG = str(ROOT / "custom_models" / "example_lm" / "config_tiny.json")


def python(*args: str) -> subprocess.CompletedProcess:
    return check(
        subprocess.run([sys.executable, *args], check=False, cwd=ROOT, env=flame_env(), capture_output=True, text=True)
    )


@pytest.fixture(scope="module")
def model():
    import flame.models  # noqa: F401  imports custom_models, as training does

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG)).eval()


def test_flame_registers_the_example_with_the_auto_classes():
    import flame.models  # noqa: F401
    from custom_models.example_lm import (
        ExampleLMConfig,
        ExampleLMForCausalLM,
        ExampleLMModel,
    )
    from flame.models import load_model_config

    config = load_model_config(CONFIG)
    assert type(config) is ExampleLMConfig and config.model_type == "flame_example_lm"
    assert type(AutoConfig.for_model("flame_example_lm")) is ExampleLMConfig
    assert type(AutoModel.from_config(config)) is ExampleLMModel
    assert type(AutoModelForCausalLM.from_config(config)) is ExampleLMForCausalLM


def test_packed_documents_do_not_see_each_other(model):
    torch.manual_seed(1)
    lengths = [5, 9, 2]
    documents = [torch.randint(0, 4096, (1, n)) for n in lengths]
    packed = torch.cat(documents, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        logits = model(packed, position_ids=position_ids).logits
        alone = torch.cat([model(document).logits for document in documents], dim=1)
        unmasked = model(packed).logits  # one long document: later tokens see earlier documents
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)
    assert not torch.allclose(unmasked[:, lengths[0] :], alone[:, lengths[0] :], atol=1e-3)

    # as flame builds it: transformers' registry with flame's attention, documents from cu_seqlens
    flame_built = AutoModelForCausalLM.from_config(load_model_config(CONFIG), attn_implementation=attention.HF_ATTENTION)
    flame_built.load_state_dict(model.state_dict())
    cu_seqlens = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    with torch.no_grad(), batch_context.computing(BatchContext(cu_seqlens=cu_seqlens, max_seqlen=9)):
        logits = flame_built(packed, position_ids=position_ids, cu_seq_lens_q=cu_seqlens).logits
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)


def test_example_trains_exports_and_generates(tmp_path, corpus, capsys):
    dump, logits_file = tmp_path / "run", tmp_path / "logits.pt"
    # two ranks: FSDP shards the blocks, and CPU init goes through a full copy (buffers too)
    args = base_args(CONFIG, corpus, dump, steps=8) + ["--optimizer.lr=1e-2"]
    check(torchrun(args, nproc=2, module=str(SCRIPTS / "train_and_save_logits.py"),
                   env={"FLAME_TEST_LOGITS": str(logits_file)}))
    loss = losses(dump)
    assert all(torch.isfinite(torch.tensor(value)) for value in loss.values()), loss
    assert max(loss[7], loss[8]) < loss[1] - 0.3, loss

    # the converter in this process (a process of its own would spend seconds importing torch again)
    assert export.main(["--path", str(dump), "--sample", "def main("]) == 0
    assert "sample from" in capsys.readouterr().out  # the converter's own load + sampling generate worked
    # a fresh process, like a user's: only `import custom_models` makes the model_type known
    result = python(str(SCRIPTS / "load_exported_and_generate.py"), str(dump / "hf"), str(logits_file))
    assert "ExampleLMForCausalLM ok" in result.stdout

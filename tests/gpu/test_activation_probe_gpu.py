"""The memory plan's GPU probe of fla models (flame.memory.activations.probed): what its saved-tensor hooks
count is what a forward really keeps on the GPU, at a row length its fit never saw."""

import pytest
import torch

from flame.memory import activations
from flame.models import load_model_config
from flame.models.builder import reinitialize
from flame.models.registry import meta_model
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["gla", "transformer", "gated_deltanet"])
def test_the_probe_counts_what_an_fla_forward_keeps_on_the_gpu(name):
    # the 340M's blocks, two of them: the shapes whose kernel choices flame ships (no autotuning here)
    config = load_model_config(str(ROOT / "configs" / f"{name}_340M.json"))
    config.num_hidden_layers = 2
    profile = activations.probe(config, torch.bfloat16, "cuda", activations.PROBE_LENGTHS)
    assert profile.method.startswith("measured (on the NVIDIA")

    model = meta_model(config).to(torch.bfloat16)
    model.to_empty(device="cuda")
    reinitialize(model)
    model.train()
    tokens = 12288  # three times the probe's longest row
    ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    logits = model(input_ids=ids, use_cache=False).logits
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - logits.untyped_storage().nbytes()
    estimate = sum(block.at(tokens) for block in profile.blocks) + profile.rest.at(tokens)
    assert estimate == pytest.approx(kept, rel=0.05), (estimate / 2**20, kept / 2**20)

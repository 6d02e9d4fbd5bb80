"""The memory plan's GPU probe of fla models (flame.memory.activations.probed): what its saved-tensor hooks
count is what a forward really keeps on the GPU, at row lengths its fit never saw, in both precisions a
job trains in (float32 weights under autocast without FSDP; bf16 weights as FSDP gathers them)."""

from contextlib import nullcontext

import pytest
import torch

from flame.memory import activations
from flame.models import load_model_config
from flame.models.builder import reinitialize
from flame.models.registry import meta_model
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("autocast", [True, False], ids=["amp", "bf16"])
@pytest.mark.parametrize("name", ["gla", "transformer", "gated_deltanet"])
def test_the_probe_counts_what_an_fla_forward_keeps_on_the_gpu(name, autocast):
    # the 340M's blocks, two of them: the shapes whose kernel choices flame ships (no autotuning here)
    config = load_model_config(str(ROOT / "configs" / f"{name}_340M.json"))
    config.num_hidden_layers = 2
    profile = activations.probe(config, torch.bfloat16, "cuda", activations.PROBE_LENGTHS, autocast)
    assert profile.method.startswith("measured (on the NVIDIA")

    model = meta_model(config)
    if not autocast:
        model = model.to(torch.bfloat16)
    model.to_empty(device="cuda")
    reinitialize(model)
    model.train()

    def kept(tokens: int) -> int:
        """Bytes the forward leaves allocated for its backward, the logits left out."""
        ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
        documents = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device="cuda")  # as the trainer gives them
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16) if autocast else nullcontext():
            logits = model(input_ids=ids, cu_seqlens=documents, use_cache=False).logits
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before - logits.untyped_storage().nbytes()

    def estimate(tokens: int) -> float:
        return sum(block.at(tokens) for block in profile.blocks) + profile.rest.at(tokens)

    # two lengths beyond the probe's longest row; their difference leaves out what does not grow with the
    # row (autocast's bf16 weight copies, which the plan counts apart)
    short, long = 6144, 12288
    assert estimate(long) - estimate(short) == pytest.approx(kept(long) - kept(short), rel=0.05)

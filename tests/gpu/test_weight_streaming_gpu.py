"""On a GPU (flame.optim.streaming): the streamed model trains as the same model held on the GPU does (bf16 weights
against autocast's bf16 copies), while the GPU holds a few blocks' weights and gradients, not the model's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.optim.streamed_adamw import StreamedAdamW
from flame.optim.streaming import WeightStream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SETTINGS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BLOCKS = 8


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=BLOCKS,
                                        num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                                        max_position_embeddings=512))


def batches(count: int):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 256), generator=generator).cuda() for _ in range(count)]


def test_a_streamed_model_trains_as_the_model_on_the_gpu_does_holding_a_few_blocks_at_a_time():
    device = torch.device("cuda", torch.cuda.current_device())
    streamed = model()
    block_bytes = 2 * sum(p.numel() for p in streamed.model.layers[0].parameters())  # one block in bf16
    stream = WeightStream(streamed, torch.bfloat16, device)
    optimizer = StreamedAdamW(streamed, stream, **SETTINGS)
    reference = model().cuda()
    plain = torch.optim.AdamW(reference.parameters(), **SETTINGS, fused=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got, expected = [], []
    for ids in batches(6):
        optimizer.zero_grad()
        loss = streamed(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        got.append(loss.item())
    streamed_peak = torch.cuda.max_memory_allocated() - before
    for ids in batches(6):
        plain.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        plain.step()
        expected.append(loss.item())
    optimizer.settle()
    print({"losses": got, "reference": expected, "streamed_peak_mib": streamed_peak / 2**20,
           "block_mib": block_bytes / 2**20, "waited_s": round(stream.waited, 3)})
    assert got == pytest.approx(expected, rel=2e-2) and got[-1] < got[0] - 0.5
    # weights and gradients of a few blocks in flight, beside small activations: far from the 8 blocks' weights
    assert streamed_peak < 0.6 * BLOCKS * block_bytes
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in streamed.parameters())
    assert all(unit.storage.nbytes() == 0 for unit in stream.blocks)

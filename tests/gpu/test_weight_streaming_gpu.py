"""On a GPU (flame.optim.streaming): the streamed model trains as the same model held on the GPU does (bf16 weights
against autocast's bf16 copies), while the GPU holds a few blocks' weights and gradients, not the model's."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.optim.streamed_adamw import StreamedAdamW
from flame.optim.streaming import WeightStream
from tests.conftest import base_args, check, losses, torchrun

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_streaming_their_shards_train_the_fsdp_losses(tmp_path, tiny_model, corpus):
    """Each rank copies its shards up, NCCL all-gathers them on the copy stream and reduce-scatters the gradients on
    the other; the curve is FSDP's (both compute in bf16), and the checkpoint resumes under FSDP."""
    streamed, plain, resumed = tmp_path / "streamed", tmp_path / "plain", tmp_path / "resumed"
    args = ["--optimizer.lr=1e-2", "--checkpoint.interval=10"]
    check(torchrun(base_args(tiny_model, corpus, streamed, steps=20) + args + ["--memory.stream_weights"], nproc=2))
    check(torchrun(base_args(tiny_model, corpus, plain, steps=20) + args, nproc=2))
    curve = losses(streamed)
    assert curve[20] < curve[1] - 0.7
    assert curve == pytest.approx(losses(plain), rel=5e-3)
    check(torchrun(base_args(tiny_model, corpus, resumed, steps=20) + args + [
        f"--checkpoint.initial_load_path={streamed / 'checkpoint' / 'step-10'}", "--checkpoint.no-initial_load_model_only"],
        nproc=2))
    assert losses(resumed) == pytest.approx({step: curve[step] for step in range(11, 21)}, rel=5e-3)

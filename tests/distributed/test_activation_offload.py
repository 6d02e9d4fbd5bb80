"""Checkpointed blocks' inputs parked on the host between the forward and the backward
(flame.distributed.activation_offload): their GPU storage is released after the forward, comes back for the
backward, and the gradients are those of full AC alone; refusals in one line."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import LlamaConfig, LlamaForCausalLM

from flame.base.errors import ConfigError
from flame.distributed.activation_offload import offload_inputs
from tests.conftest import TINY_DECODER, base_args, parse_job


def _checkpointed_llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": layers}, vocab_size=512))
    stack = model.model.layers
    for index, block in enumerate(list(stack)):
        stack[index] = checkpoint_wrapper(block)  # torch's non-reentrant checkpoint, as full AC wraps each block
    return model


def test_parked_inputs_leave_the_device_memory_and_come_back_for_an_identical_backward():
    ids = torch.randint(0, 512, (2, 16))
    reference, parked = _checkpointed_llama(4), _checkpointed_llama(4)
    reference(ids).logits.square().mean().backward()
    offload = offload_inputs(parked.model.layers, count=4)
    assert offload.count == 3  # the last block keeps its input: its backward comes first
    loss = parked(ids).logits.square().mean()
    inputs = [offload.parked[index].tensor for index in range(3)]
    assert [tensor.untyped_storage().nbytes() for tensor in inputs] == [0, 0, 0]  # released after the forward
    loss.backward()
    assert all(tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() for tensor in inputs)
    theirs = dict(reference.named_parameters())
    for name, param in parked.named_parameters():
        assert torch.equal(param.grad, theirs[name].grad), name
    assert offload.parked == [None] * 4  # nothing left on the host
    with torch.no_grad():  # no backward: nothing parked
        parked(ids)
    assert offload.parked == [None] * 4


@pytest.mark.parametrize(("flags", "message"), [
    (["--activation_checkpoint.offload"], "add --activation_checkpoint.mode full"),
    (["--activation_checkpoint.offload", "--activation_checkpoint.mode=full", "--parallelism.pipeline_parallel_degree=2"],
     "leave it off under pipeline parallelism"),
])
def test_offload_without_full_ac_is_refused(tiny_model, corpus, tmp_path, monkeypatch, flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(monkeypatch, 2, *base_args(tiny_model, corpus, tmp_path / "x"), *flags)

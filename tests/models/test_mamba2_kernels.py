"""fla's Mamba2 layer under flame (flame.models.kernels.mamba2): fla's math, each packed document on its own.

fla's Triton norms run on CPU as PyTorch stand-ins (tests/scripts/torch_kernels.py); the conv
and scan are flame's PyTorch ones, and in the last test fla's and mamba_ssm's Triton kernels under
Triton's interpreter (tests/scripts/mamba2_interpreted.py). tests/gpu/test_mamba2_gpu.py runs the kernels on GPUs.
"""

import itertools
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from flame.models.kernels import mamba2
from flame.models import load_model_config
from tests.conftest import ROOT, SCRIPTS, check, flame_env
from tests.scripts.torch_kernels import use_torch_kernels

TINY = ROOT / "configs/tiny/mamba2.json"
LENGTHS = [37, 5, 70, 16]  # documents crossing the scan's 64-token chunks; one shorter than the conv


def tiny_mamba2(**changes) -> torch.nn.Module:
    config = load_model_config(str(TINY))  # imports fla: flame's changes to it apply
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    use_torch_kernels(model)
    return model


def logits_and_grads(model, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(ids, **kwargs).logits
    (logits.float().pow(2).sum() * 1e-3 + logits.float()[..., :8].sum()).backward()  # a sum over tokens
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_close(got, expected, tolerance: float = 1e-4) -> None:
    """Logits and every gradient equal to ``tolerance`` of their largest entry (float32 sums in other orders)."""
    (got_logits, got_grads), (expected_logits, expected_grads) = got, expected
    assert got_grads.keys() == expected_grads.keys()
    for name, want in [("logits", expected_logits), *expected_grads.items()]:
        have = got_logits if name == "logits" else got_grads[name]
        error = (have - want).abs().max() / want.abs().max().clamp(min=1e-6)
        assert error < tolerance, (name, float(error))


def fla_torch_forward(monkeypatch) -> None:
    """Make the Mamba2 layers run fla's own forward (its torch_forward on CPU) instead of flame's."""
    from fla.layers.mamba2 import Mamba2

    monkeypatch.setattr(Mamba2, "forward", Mamba2.forward.__wrapped__)


@pytest.mark.parametrize("changes", [{}, {"n_groups": 2, "D_has_hdim": True, "norm_before_gate": True},
                                     {"rmsnorm": False, "dt_limit": (0.01, 0.5), "use_bias": True}])
def test_one_document_gives_fla_s_logits_and_gradients(monkeypatch, changes):
    """flame's forward is fla's torch_forward's function of the same parameters (options included)."""
    model = tiny_mamba2(chunk_size=32, **changes)  # fla's torch_forward's chunk: 256 costs seconds on CPU
    assert type(model.backbone.layers[0].mixer).forward.keeps_documents_apart
    ids = torch.randint(0, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(1))
    flame = logits_and_grads(model, ids)
    fla_torch_forward(monkeypatch)
    assert_close(flame, logits_and_grads(model, ids))


def test_fla_s_warning_against_its_triton_conv_is_dropped_and_others_are_kept():
    """flame chose fla's Triton conv (checked here and on GPUs); fla warns once per layer it builds."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    fla_logger = logging.getLogger(mamba2.FLA_MAMBA2)
    fla_logger.addHandler(handler)
    try:
        tiny_mamba2()
        fla_logger.warning("another warning")
    finally:
        fla_logger.removeHandler(handler)
    messages = [record.getMessage() for record in records]
    assert "another warning" in messages
    assert not [message for message in messages if "Triton's conv1d backend" in message], messages


def test_a_packed_row_gives_each_document_its_own_results():
    model = tiny_mamba2()
    ids = torch.randint(0, model.config.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    packed_logits, packed_grads = logits_and_grads(model, ids, cu_seqlens=cu_seqlens)
    alone = [logits_and_grads(model, piece) for piece in ids.split(LENGTHS, dim=1)]
    separate_logits = torch.cat([logits for logits, _ in alone], dim=1)
    separate_grads = {name: sum(grads[name] for _, grads in alone) for name in packed_grads}
    assert_close((packed_logits, packed_grads), (separate_logits, separate_grads))


def test_without_documents_the_row_is_one_sequence():
    """The same row without cu_seqlens differs after the first document: the scan really is reset above."""
    model = tiny_mamba2()
    ids = torch.randint(0, model.config.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        packed, whole = model(ids, cu_seqlens=cu_seqlens).logits, model(ids).logits
    first = LENGTHS[0]
    torch.testing.assert_close(packed[:, :first], whole[:, :first])
    assert (packed[:, first:] - whole[:, first:]).abs().max() > 1e-2


def test_the_chunked_scan_is_the_simple_gla_recurrence_per_document():
    """scan_torch (chunked, resets at documents) = fla's token-by-token simple GLA over each document alone."""
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    generator = torch.Generator().manual_seed(3)
    lengths, heads, key, value = [11, 1, 30, 6], 3, 5, 4
    total = sum(lengths)
    q, k, v = (torch.randn(1, total, heads, d, generator=generator, requires_grad=True) for d in (key, key, value))
    g = (-torch.rand(1, total, heads, generator=generator)).requires_grad_()
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    o, states = mamba2.scan_torch(q, k, v, g, cu_seqlens, final_states=True, chunk=8)
    expected, expected_states = [], []
    for start, end in itertools.pairwise(cu_seqlens):
        piece = naive_recurrent_simple_gla(*(t[:, start:end] for t in (q, k, v, g)), scale=1.0)
        expected.append(piece[0])
        expected_states.append(piece[1][0].transpose(-1, -2))  # [heads, value, key]: fla's Mamba2 cache layout
    expected = torch.cat(expected, dim=1)
    torch.testing.assert_close(o, expected)
    torch.testing.assert_close(states, torch.stack(expected_states))
    weights = torch.randn_like(o, generator=generator)
    got = torch.autograd.grad((o * weights).sum(), (q, k, v, g))
    for grad, want in zip(got, torch.autograd.grad((expected * weights).sum(), (q, k, v, g))):
        torch.testing.assert_close(grad, want)


def test_generation_continues_from_the_prompt_s_states():
    """A prompt through flame's prefill, then fla's cached decoding: the logits of the whole sequence at once."""
    model = tiny_mamba2().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model(ids).logits
        out = model(ids[:, :20], use_cache=True)
        steps = [out.logits]
        for t in range(20, 24):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-4)


def test_fla_s_triton_kernels_give_the_pytorch_results_under_triton_s_interpreter():
    """fla's causal_conv1d with fla's chunk_simple_gla or chunk_gla, or mamba_ssm's SSD scan (recomputed in the
    backward or not), interpreted on CPU: flame's kernel paths = its PyTorch path."""
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "mamba2_interpreted.py")], check=False, cwd=ROOT,
                                  env={**flame_env(threads=2), "TRITON_INTERPRET": "1"}, capture_output=True,
                                  text=True, timeout=600))
    assert result.stdout.strip().splitlines()[-1] == "kernels = pytorch"

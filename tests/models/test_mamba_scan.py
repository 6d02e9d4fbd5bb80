"""fla's Mamba layer (mamba, samba) with flame's selective scan: documents start from zero state, fla's math kept.

The Triton kernels run on the CPU under Triton's interpreter (a fresh process:
tests/scripts/mamba_scan_interpreted.py); the models run flame's PyTorch path, with PyTorch
stand-ins for fla's Triton norms, rotary embeddings and SwiGLU (they need a GPU; they are no
part of what is tested here). tests/gpu/test_mamba_scan_gpu.py holds the kernels to the same on GPUs.
"""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flame.models import load_model_config
from flame.models.registry import import_fla
from flame.models.kernels.selective_scan import document_conv, reference_scan
from flame.models.support import Documents, support_for
from tests.conftest import ROOT, SCRIPTS, check, flame_env

DOCUMENTS = [9, 23, 16]  # one packed row of 48 tokens


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def test_triton_kernels_match_the_reference_with_documents_and_rows():
    result = check(subprocess.run([sys.executable, str(SCRIPTS / "mamba_scan_interpreted.py")], check=False, cwd=ROOT,
                                  env=flame_env(threads=2), capture_output=True, text=True, timeout=120))
    report = json.loads(result.stdout.splitlines()[-1])
    for case, differences in report.items():
        assert set(differences) == {"y", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias"}, case
        assert max(differences.values()) < 1e-5, (case, differences)


def test_reference_scan_restarts_at_every_document():
    torch.manual_seed(0)
    channels, states = 6, 4
    x, dt, z = (torch.randn(1, sum(DOCUMENTS), channels) for _ in range(3))
    B, C = (torch.randn(1, sum(DOCUMENTS), states) for _ in range(2))
    A, D, bias = -torch.rand(channels, states) - 0.5, torch.randn(channels), torch.randn(channels)
    packed = reference_scan(x, dt, A, B, C, D, z, bias, cu_seqlens_of(DOCUMENTS))
    pieces = [torch.split(v, DOCUMENTS, dim=1) for v in (x, dt, B, C, z)]
    alone = [reference_scan(xi, dti, A, Bi, Ci, D, zi, bias) for xi, dti, Bi, Ci, zi in zip(*pieces)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1))
    assert not torch.allclose(packed, reference_scan(x, dt, A, B, C, D, z, bias))  # the state did carry over


def test_document_conv_is_the_layers_conv1d_per_document():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 8, kernel_size=4, groups=8, padding=3)
    x = torch.randn(1, sum(DOCUMENTS), 8)
    packed = F.silu(document_conv(x, conv.weight.squeeze(1), conv.bias, cu_seqlens_of(DOCUMENTS)))
    alone = [F.silu(conv(doc.transpose(1, 2))[..., : doc.shape[1]]).transpose(1, 2)
             for doc in torch.split(x, DOCUMENTS, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1))


def mamba_layer():
    import_fla()  # flame's changes to fla, flame's Mamba forward among them
    from fla.layers.mamba import Mamba

    torch.manual_seed(0)
    layer = Mamba(hidden_size=32, state_size=8, intermediate_size=48, layer_idx=0)
    layer.act = F.silu  # fla's slow path calls its Triton SiLU, which needs a GPU
    return layer


def test_flames_path_is_flas_slow_path_on_one_document():
    from flame.compat.guard import applied

    layer = mamba_layer()
    assert type(layer).forward.scans_documents and "fla.mamba_scans_documents" in applied()
    hidden = torch.randn(2, 21, 32, requires_grad=True)
    outputs, gradients = [], []
    for run in (lambda h: layer(h)[0], lambda h: layer.slow_forward(h)[0]):
        layer.zero_grad()
        out = run(hidden)
        out.pow(2).sum().backward()
        outputs.append(out)
        gradients.append([hidden.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
        hidden.grad = None
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    for flame_grad, fla_grad in zip(*gradients):
        torch.testing.assert_close(flame_grad, fla_grad, rtol=1e-4, atol=1e-5)


def test_cached_decoding_keeps_flas_path_and_refuses_packed_documents():
    layer = mamba_layer()
    hidden = torch.randn(1, sum(DOCUMENTS), 32)
    with pytest.raises(ValueError, match="one sequence per row, not packed documents"):
        layer(hidden, use_cache=True, cu_seqlens=cu_seqlens_of(DOCUMENTS))
    torch.testing.assert_close(layer(hidden, use_cache=True)[0], layer.slow_forward(hidden)[0])


def test_a_left_padded_batch_gives_each_sequence_its_results_alone():
    # flame.eval batches padded sequences for the types that honour padding (their record)
    layer = mamba_layer()
    short, long_ = torch.randn(1, 16, 32), torch.randn(1, 21, 32)
    padded = torch.cat([torch.cat([torch.randn(1, 5, 32), short], dim=1), long_])
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[0, :5] = 0
    out = layer(padded, attention_mask=mask)[0]
    torch.testing.assert_close(out[:1, 5:], layer(short)[0])
    torch.testing.assert_close(out[1:], layer(long_)[0])


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """PyTorch stand-ins for the Triton kernels of fla's norms, rotary embeddings and SwiGLU (CUDA only)."""
    import_fla()
    from fla.modules import RMSNorm, mlp
    from fla.modules.rotary import ops as rotary

    def rms_norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        x = x if residual is None else x + residual
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return (out, x) if prenorm else out

    def rotary_embedding(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None, **kwargs):
        index = torch.arange(x.shape[1])
        if cu_seqlens is not None:  # positions restart at every document, as fla's kernel counts them
            index = index - cu_seqlens[torch.searchsorted(cu_seqlens, index, right=True) - 1]
        return rotary.rotary_embedding_ref(x, cos[index + seqlen_offsets], sin[index + seqlen_offsets], interleaved)

    monkeypatch.setattr(RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(rotary, "rotary_embedding", rotary_embedding)
    monkeypatch.setattr(mlp, "swiglu", lambda x, y: F.silu(x) * y)


@pytest.mark.parametrize("model_type", ["mamba", "samba"])
def test_a_packed_row_computes_its_documents_as_if_run_separately(fla_on_cpu, model_type):
    from transformers import AutoModelForCausalLM

    config = load_model_config(str(ROOT / f"configs/tiny/{model_type}.json"))
    config.fuse_norm, config.fuse_swiglu = False, False  # the unfused modules, which the stand-ins replace
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (1, sum(DOCUMENTS)))
    probe = torch.randn(sum(DOCUMENTS), config.vocab_size)  # a loss touching every logit

    def run(pieces):
        model.zero_grad()
        logits = torch.cat([model(piece, use_cache=False, **kwargs).logits for piece, kwargs in pieces], dim=1)
        (logits[0] * probe).sum().backward()
        return logits, {name: p.grad.clone() for name, p in model.named_parameters()}

    packed, packed_grads = run([(ids, {"cu_seqlens": cu_seqlens_of(DOCUMENTS)})])
    alone, alone_grads = run([(doc, {}) for doc in torch.split(ids, DOCUMENTS, dim=1)])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    for name, grad in packed_grads.items():
        # float32 sums in another order: a tolerance scaled to each gradient
        atol = 1e-5 * max(grad.abs().max().item(), 1.0)
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    row, _ = run([(ids, {})])  # without the documents the state crosses them
    assert not torch.allclose(row[:, DOCUMENTS[0]:], packed[:, DOCUMENTS[0]:], atol=1e-3)


@pytest.mark.parametrize("model_type", ["mamba", "samba"])
def test_mamba_and_samba_take_documents_as_cu_seqlens(model_type):
    record = support_for(model_type)
    assert record.documents is Documents.CU_SEQLENS and not record.not_isolated_because
    assert record.honours_padding  # fla's Mamba layer zeroes padded tokens; flame's path does too


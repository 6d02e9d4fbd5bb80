"""transformers' hybrids on CUDA (flame.models.hybrid): with their layers over the flattened batch on flame's varlen
kernels (fla's conv, gated delta rule and KDA; mamba_ssm's SSD scan or fla's simple GLA; flame's selective scan),
a packed batch gives each document the logits and gradients it gets alone through transformers' own kernels.
tests/models/test_hybrids.py checks the same wiring on CPU with stand-ins. Skipped where there is no CUDA device."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from flame.models import hybrid, load_model_config, moe
from flame.models.builder import FlameModelArgs, build_model
from tests.conftest import ROOT
from tests.models.test_hybrids import HYBRIDS, _batch, _packed_logits, _separate_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _results(model, logits_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of the summed cross entropy."""
    model.zero_grad()
    batch, labels = _batch()
    batch = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    logits = logits_of(model, batch, labels.cuda())
    F.cross_entropy(logits.float().flatten(0, 1), labels.cuda().flatten(), reduction="sum").backward()
    return logits.detach().float(), {name: p.grad.float().clone() for name, p in model.named_parameters()}


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the largest entry."""
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_packed_documents_get_their_logits_and_gradients_alone_on_varlen_kernels(model_type):
    path = str(ROOT / "configs" / "tiny" / f"{model_type}.json")
    args = FlameModelArgs(config_path=path, fused_kernels=False)
    args._config = load_model_config(path)
    torch.manual_seed(0)
    model = build_model(args).cuda().train()
    layers = [m for m in model.modules() if isinstance(m, hybrid.KeepsDocumentsApart)]
    assert layers and all(layer.over_flattened_batch for layer in layers)
    with torch.no_grad():  # decisive routers: the two kernels' rounding must not flip a token's top-k experts,
        for router in moe.routers(model):  # which moves whole tokens' gradients between experts
            router.weight.mul_(50)
    packed_logits, packed_grads = _results(model, _packed_logits)
    separate_logits, separate_grads = _results(model, lambda model, batch, _: _separate_logits(model, batch))
    assert _error(packed_logits, separate_logits) < 1e-2
    errors = {name: _error(packed_grads[name], grad) for name, grad in separate_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 2e-2, (worst, errors[worst])


def _norm_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_a_qwen3_5_shaped_0_8b_model_in_bf16_gives_packed_documents_their_own_logits():
    """At the size users train (configs/qwen3_5_0.8B.json, 36 layers, bf16 weights): four documents packed into one
    8K row get the logits each gets alone on the same kernels, and differ from transformers' own forward of each
    alone by no more than flame's forward of it alone does (bf16 noise: other kernels, other rounding); the row read
    as one document does not."""
    path = str(ROOT / "configs" / "qwen3_5_0.8B.json")
    args = FlameModelArgs(config_path=path, fused_kernels=False)
    args._config = load_model_config(path)
    torch.manual_seed(0)
    model = build_model(args).to("cuda", torch.bfloat16).eval()
    documents = [700, 2300, 1100, 4092]
    bounds = [0, *itertools.accumulate(documents)]
    ids = torch.randint(0, 32000, (1, bounds[-1]), device="cuda")

    def flame_logits(start: int, end: int) -> torch.Tensor:
        lengths = [n for n, first in zip(documents, bounds) if start <= first < end]
        batch = {"input": ids[:, start:end], "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].cuda(),
                 "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda"),
                 "max_seqlen": max(lengths)}
        return _packed_logits(model, batch, ids[:, start:end]).float()

    with torch.no_grad():
        packed = flame_logits(0, bounds[-1])
        pieces = list(zip(bounds, bounds[1:]))
        flame_alone = torch.cat([flame_logits(start, end) for start, end in pieces], dim=1)
        hf_alone = torch.cat([model(ids[:, start:end], use_cache=False).logits.float() for start, end in pieces], dim=1)
        leaked = model(ids, use_cache=False).logits.float()
    later = slice(bounds[1], None)  # the first document is the same either way; the others see their own past only
    same_kernels, floor = _norm_error(packed, flame_alone), _norm_error(flame_alone, hf_alone)
    against_hf, leak = _norm_error(packed, hf_alone), _norm_error(leaked[:, later], hf_alone[:, later])
    print(f"packed vs alone: {same_kernels:.2e} (flame's kernels), {against_hf:.2e} (transformers'); flame vs "
          f"transformers alone {floor:.2e}; one document vs alone {leak:.2e}")
    assert same_kernels < 1e-2
    assert against_hf <= 2 * floor + 1e-3
    assert leak > 10 * against_hf

"""z-loss and logit softcap (--training.z_loss, --training.logit_softcap): inside the fused, chunked cross entropy,
its vocabulary-parallel form and the logits path, each equal to a reference computed on the full logits, with
gradients to match; the z term is kept for the log; misuse is refused in one line."""

import pytest
import torch
import torch.nn.functional as F

from flame.base.errors import ConfigError
from flame.models import loss
from flame.models.loss import LogitTerms, cross_entropy_sum, linear_cross_entropy_sum
from flame.config.manager import parse
from flame.prepare import prepare
from torchtitan.components.loss import IGNORE_INDEX

from tests.conftest import check, metrics, train_job

TERMS = [LogitTerms(), LogitTerms(z_loss=1e-2), LogitTerms(softcap=5.0), LogitTerms(z_loss=1e-2, softcap=5.0)]


def reference(hidden, weight, targets, terms: LogitTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss, the summed z term) from the full logits, by autograd's own derivatives."""
    logits = (hidden @ weight.T).float()
    if terms.softcap:
        logits = terms.softcap * torch.tanh(logits / terms.softcap)
    keep = targets != IGNORE_INDEX
    z = (terms.z_loss * torch.logsumexp(logits, -1) ** 2 * keep).sum()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_INDEX) + z, z


def problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(70, 16, generator=generator) * 3).requires_grad_()
    weight = torch.randn(50, 16, generator=generator).requires_grad_()
    targets = torch.randint(0, 50, (70,), generator=generator)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("terms", TERMS, ids=["plain", "z-loss", "softcap", "both"])
def test_the_fused_chunked_loss_equals_the_full_logits_reference_with_its_gradients(monkeypatch, terms):
    monkeypatch.setattr(loss, "CHUNK_TOKENS", 16)  # several chunks and a short last one
    hidden, weight, targets = problem()
    expected, z = reference(hidden, weight, targets, terms)
    expected.backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss.take_z_sum()
    got = linear_cross_entropy_sum(hidden, weight, None, targets, terms=terms)
    got.backward()
    assert torch.allclose(got, expected, rtol=1e-5)
    assert torch.allclose(hidden.grad, want[0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(weight.grad, want[1], rtol=1e-4, atol=1e-4)
    taken = loss.take_z_sum()
    assert (taken is None) if not terms.z_loss else torch.allclose(taken, z, rtol=1e-5)


@pytest.mark.parametrize("terms", TERMS[1:], ids=["z-loss", "softcap", "both"])
def test_the_logits_path_equals_the_reference(terms):
    hidden, weight, targets = problem(1)
    expected, z = reference(hidden, weight, targets, terms)
    loss.take_z_sum()
    got = cross_entropy_sum((hidden @ weight.T)[None], targets[None], terms)
    assert torch.allclose(got, expected, rtol=1e-5)
    assert not terms.z_loss or torch.allclose(loss.take_z_sum(), z, rtol=1e-5)


def test_the_vocabulary_parallel_shard_function_sums_to_the_reference():
    # two vocabulary shards of one rank group (world size 1: the all-reduces are the identity), each a half of
    # the vocabulary: the loss from one shard with the other's sums added by hand equals the reference's
    hidden, weight, targets = problem(2)
    terms = LogitTerms(z_loss=1e-2, softcap=5.0)
    expected, _ = reference(hidden, weight, targets, terms)
    logits = (hidden @ weight.T).detach().float()
    scores = terms.softcap * torch.tanh(logits / terms.softcap)
    shift = scores.max(-1).values
    keep = targets != IGNORE_INDEX
    mine = keep.clone()
    sums = loss._shard_sums(scores, shift, torch.where(keep, targets, 0), mine)
    got, _, _ = loss._shard_loss_and_grad(scores, shift, sums, torch.where(keep, targets, 0), mine, keep,
                                          torch.float32, terms.z_loss, terms.softcap)
    assert torch.allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--training.z_loss=-1"], "--training.z_loss must be a number at least 0"),
    (["--training.logit_softcap=nan"], "--training.logit_softcap must be a number at least 0"),
    (["--training.z_loss=1e-4", "--parallelism.tensor_parallel_degree=2"],
     "computed inside the fused cross entropy, which this run does not use"),
])
def test_misuse_is_refused_in_one_line(tiny_model, flags, message):
    args = ["--model.config", tiny_model, "--training.dataset", "builtin:python-stdlib",
            "--model.tokenizer_path", "builtin:python-stdlib-bpe", *flags]
    with pytest.raises(ConfigError, match=message):
        prepare(parse(args), 2)


@pytest.mark.background_runs(terms=train_job(3, "--training.z_loss=1e-2", "--training.logit_softcap=30"))
def test_a_run_logs_its_z_term_as_part_of_its_loss(background_runs):
    run = background_runs["terms"]
    check(run.result)
    for step, row in metrics(run.dump).items():
        assert 0 < row["loss_metrics/z_loss"] < row["loss_metrics/global_avg_loss"], (step, row)

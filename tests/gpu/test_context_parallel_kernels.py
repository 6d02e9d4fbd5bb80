"""Context parallelism's CUDA attention paths (skipped where there is no CUDA device).

Each rank's local queries against the all-gathered keys, with torch's varlen kernel (bf16;
flame relies on its bottom-right alignment when a sequence has fewer queries than keys) and
with FlexAttention (fp32), against the whole batch's dense attention, outputs and gradients.
"""

import random

import pytest
import torch

from tests.test_context_parallel import DOCUMENTS, check_against_whole_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _long_documents(total: int = 4096, seed: int = 0) -> list[int]:
    random.seed(seed)
    bounds = sorted(random.sample(range(1, total), 9))
    return [0, *bounds, total]


@pytest.mark.parametrize("documents", [DOCUMENTS, _long_documents()], ids=["short", "long"])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("window", [None, 100])
def test_varlen_attention_of_local_queries_matches_the_whole_batch(documents, balanced, window):
    check_against_whole_batch("varlen", 2, balanced, window, documents, "cuda", torch.bfloat16, atol=3e-2, rtol=3e-2, dim=64)


@pytest.mark.parametrize("documents", [DOCUMENTS, _long_documents()], ids=["short", "long"])
@pytest.mark.parametrize("balanced", [True, False])
def test_flex_attention_of_local_queries_matches_the_whole_batch(documents, balanced):
    check_against_whole_batch("flex", 4, balanced, 100, documents, "cuda", torch.float32, atol=1e-4, dim=64)

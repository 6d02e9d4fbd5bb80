"""flame.eval on a GPU: fla models score a padded batch as one sequence at a time (fla's kernels need CUDA)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, TOKENIZER

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("config", ["gla", "transformer"])
def test_fla_padded_batches_score_as_one_sequence_at_a_time(config, tmp_path):
    import flame
    from flame.data.tokenizer import load_tokenizer
    from flame.eval.model import batch_size_for
    from flame.models import load_model_config
    from tests.test_eval import loglikelihoods

    flame.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs" / "tiny" / f"{config}.json")))
    model = model.to("cuda", torch.float32 if config == "transformer" else torch.bfloat16).eval()
    tokenizer = load_tokenizer(TOKENIZER)
    assert batch_size_for(model, 8) == 8  # its layers unpad by the attention mask
    batched, alone = loglikelihoods(model, tokenizer, 8), loglikelihoods(model, tokenizer, 1)
    tolerance = 1e-3 if config == "transformer" else 5e-2  # bf16 kernels tile a batch differently
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=0, atol=tolerance)
    assert all(torch.isfinite(torch.tensor(batched)))

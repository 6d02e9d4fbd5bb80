"""flame.eval on a GPU: fla models score a padded batch as one sequence at a time (fla's kernels need CUDA)."""

import json
import os

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
    from tests.eval.test_eval import loglikelihoods

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


def test_batches_reach_the_model_in_a_few_lengths_with_the_logits_of_their_own():
    import flame
    from flame.data.tokenizer import load_tokenizer
    from flame.eval.model import FlameLM
    from flame.models import load_model_config

    flame.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(str(ROOT / "configs" / "tiny" / "gla.json")))
    model = model.to("cuda", torch.bfloat16).eval()
    lm = FlameLM(model, load_tokenizer(TOKENIZER), rank=0, world_size=1, batch_size=4)
    lengths = []
    model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    inps = torch.randint(0, model.config.vocab_size, (4, 37), device="cuda")
    logits = lm._model_call(inps)
    assert lengths == [64] and logits.shape[:2] == (4, 37)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(inps).logits, rtol=0, atol=2e-2)  # bf16: other tiles


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_the_scores_of_one_for_an_fla_model(tmp_path):
    import subprocess

    from tests.eval.test_eval import OFFLINE, TASKS, TASKS_DIR, make_export, results

    export = make_export(tmp_path / "gla", json.loads((ROOT / "configs" / "tiny" / "gla.json").read_text()))
    scores = {}
    for gpus in (1, 2):  # the first run caches the kernels' tile choices; the second reads them
        out = tmp_path / f"gpus{gpus}"
        subprocess.run(["bash", "eval.sh", "--model", str(export), "--tasks", TASKS, "--include_path", TASKS_DIR,
                        "--batch_size", "4", "--output_path", str(out)], cwd=ROOT, check=True, timeout=600,
                       env={**os.environ, **OFFLINE, "NGPU": str(gpus)})
        scores[gpus] = results(out)
    assert scores[2] == scores[1]  # exactly

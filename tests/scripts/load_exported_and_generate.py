"""In a fresh process, like a user's: load an exported custom model through transformers and generate.

    python tests/scripts/load_exported_and_generate.py HF_DIR LOGITS_FILE

HF_DIR is a custom_models/ model exported by convert_dcp_to_hf; LOGITS_FILE holds the trained
model's logits on fixed input ids (written by train_and_save_logits.py). Only ``import
custom_models`` makes the model_type known to transformers here. Checks that the loaded model
gives the same logits and greedily generates the trained model's next token, then prints
"<model class> ok" (test_custom_model.py looks for it); any mismatch is an AssertionError.
"""

import sys

import torch
from transformers import AutoModelForCausalLM

import custom_models  # noqa: F401  (registers the custom model types with the Auto classes)

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
expected = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(expected["input_ids"]).logits
torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=1e-5)
prompt = expected["input_ids"][:1, :6]
out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
assert out.shape == (1, 11) and torch.equal(out[:, :6], prompt), out
assert out[0, 6] == expected["logits"][0, 5].argmax(), out  # the trained model's greedy choice
print(type(model).__name__, "ok")

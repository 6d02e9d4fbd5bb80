"""Train with flame (one process), then compute the loss of the --model.init_from model itself, loaded by
transformers, on the batch of flame's first step; save it.

    python -m torch.distributed.run --nproc_per_node=1 tests/scripts/init_from_parity.py OUT.json <flame.train args>

The run must give --model.init_from and --training.no-document_mask (causal attention over whole
rows, which the HF model computes alike). OUT.json: {"hf_loss": <the HF model's step-1 loss>}.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import init_logger
from transformers import AutoModelForCausalLM

from flame.prepare import prepared
from flame.training.trainer import Trainer


class FirstBatchTrainer(Trainer):
    first = None  # (input ids, position ids, labels, global target count) of step 1

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.first is None:
            self.first = (input_dict["input"].clone(), input_dict.get("position_ids"), labels.clone(), global_valid_tokens)
        return super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)


if __name__ == "__main__":
    out = sys.argv[1]
    init_logger()
    trainer = FirstBatchTrainer(prepared(sys.argv[2:]))
    try:
        trainer.train()
        assert trainer.gradient_accumulation_steps == 1  # the first micro-batch is the step's batch
        ids, positions, labels, count = trainer.first
        model = AutoModelForCausalLM.from_pretrained(trainer.job_config.model.init_from, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
        with open(out, "w") as f:
            json.dump({"hf_loss": (loss / count).item()}, f)
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()

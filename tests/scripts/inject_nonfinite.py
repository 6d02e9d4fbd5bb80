"""Train with flame, but make the gradients non-finite at the steps in FLAME_TEST_BAD_STEPS (FLAME_TEST_BAD=loss: the
loss instead, its gradients left finite)."""

import os
import sys

import torch

from flame.prepare import prepared
from flame.training.trainer import Trainer

BAD_STEPS = {int(step) for step in os.environ["FLAME_TEST_BAD_STEPS"].split(",")}
BAD_LOSS = os.environ.get("FLAME_TEST_BAD") == "loss"


class InjectingTrainer(Trainer):
    def forward_backward_step(self, **kwargs):
        loss = super().forward_backward_step(**kwargs)
        if self.step in BAD_STEPS and BAD_LOSS:
            return loss * float("nan")  # after its backward: the gradients stay finite
        if self.step in BAD_STEPS:
            next(p for p in self.model_parts[0].parameters() if p.grad is not None).grad.fill_(float("inf"))
        return loss


if __name__ == "__main__":
    trainer = InjectingTrainer(prepared(sys.argv[1:]))
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()

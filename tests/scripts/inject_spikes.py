"""Train with flame, but make some steps spike, as a diverging run does.

FLAME_TEST_GRAD_SPIKES lists the steps whose gradients are multiplied by 100 (the second listed
by 100**2, and so on: each spike larger than the last), FLAME_TEST_LOSS_SPIKES those whose
reported loss is multiplied by 10 (its gradients unchanged). Either may be empty. Takes
flame.train's arguments and exits as it does (2 bad input, 1 a stop).
"""

import os
import sys

from flame import train

from flame.training import trainer
from flame.training.trainer import Trainer


def _steps(name: str) -> set[int]:
    return {int(step) for step in os.environ.get(name, "").split(",") if step}


GRAD_SPIKES, LOSS_SPIKES = sorted(_steps("FLAME_TEST_GRAD_SPIKES")), _steps("FLAME_TEST_LOSS_SPIKES")


class SpikingTrainer(Trainer):
    def forward_backward_step(self, **kwargs):
        loss = super().forward_backward_step(**kwargs)
        if self.step in GRAD_SPIKES:
            for p in self.model_parts[0].parameters():
                if p.grad is not None:
                    p.grad.mul_(100 ** (GRAD_SPIKES.index(self.step) + 1))
        return loss * 10 if self.step in LOSS_SPIKES else loss


if __name__ == "__main__":
    trainer.Trainer = SpikingTrainer  # flame.train imports it from there as it starts training
    sys.exit(train.main())

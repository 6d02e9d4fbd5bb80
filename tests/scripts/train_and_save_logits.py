"""Train with flame, then save the final model's logits on fixed input ids (rank 0) to FLAME_TEST_LOGITS."""

import os
import sys

import torch
from torch.distributed.tensor import DTensor

from flame.prepare import prepared
from flame.training.trainer import Trainer

if __name__ == "__main__":
    trainer = Trainer(prepared(sys.argv[1:]))
    try:
        trainer.train()
        model = trainer.model_parts[0]
        model.eval()
        input_ids = torch.arange(3, 3 + 2 * 48).remainder(4096).reshape(2, 48)
        with torch.no_grad():
            logits = model(input_ids).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        if torch.distributed.get_rank() == 0:
            torch.save({"input_ids": input_ids, "logits": logits}, os.environ["FLAME_TEST_LOGITS"])
        # the ranks tear down together, as flame.train's do after their last collective. Without
        # this, rank 1 went on alone while rank 0 saved, and twice (in full test runs) it died at
        # its exit: SIGABRT, "terminate called without an active exception". Not reproduced alone.
        torch.distributed.barrier()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()

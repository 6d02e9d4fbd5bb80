"""Train with flame's LoRA, then PEFT's own LoRA model in a plain loop on the same batches; save both.

    python -m torch.distributed.run --nproc_per_node=1 tests/scripts/lora_parity.py BASE_DIR OUT.pt <flame.train args>

BASE_DIR is the HF model the run starts from (its weights are the run's step-0 checkpoint,
written by convert_hf_to_dcp). The flame run records every micro-batch it trains on, each
step's learning rate, and its model as the first step finds it. Then the reference: PEFT's
``get_peft_model`` over BASE_DIR's model with the run's LoRA settings, the adapters' start
copied from flame's (PEFT draws its init from another point of the RNG stream), trained with
torch's AdamW (flame's optimizer's hyperparameters), the same loss normalization and gradient
clip. OUT.pt holds both loss curves, flame's weights at the start, and the final logits of both
models on fixed ids.
"""

import sys

import torch
from peft import get_peft_model
from torchtitan.tools.logging import init_logger

from flame.models.loss import cross_entropy_sum
from flame.prepare import prepared
from flame.models.lora import LoraSettings
from flame.training.trainer import Trainer


class RecordingTrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.steps: list[dict] = []
        self.start: dict[str, torch.Tensor] | None = None

    def train_step(self, data_iterator):
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        self.steps.append({"lr": lr, "batches": [], "loss": 0.0})
        super().train_step(data_iterator)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.start is None:  # the weights the first step trains from: init, then the step-0 load
            self.start = {name: p.detach().clone() for name, p in self.model_parts[0].named_parameters()}
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
        step = self.steps[-1]
        step["batches"].append((input_dict["input"].clone(), input_dict.get("position_ids"), labels.clone(), global_valid_tokens))
        step["loss"] += loss.item()
        return loss


def logits_on_fixed_ids(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.arange(3, 3 + 2 * 48).remainder(4096).reshape(2, 48)).logits


def train_peft(base_dir: str, trainer: RecordingTrainer) -> tuple[list[float], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    job = trainer.job_config
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(base, LoraSettings.of(job.lora).peft_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # base_model.model.<flame's name>
                param.copy_(trainer.start[name.removeprefix("base_model.model.")])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    defaults = trainer.optimizers.optimizers[0].defaults
    optimizer = torch.optim.AdamW(params, **{k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "fused", "foreach")})
    losses = []
    for number, step in enumerate(trainer.steps, start=1):
        torch.manual_seed((job.debug.seed or 0) * 1_000_003 + number)  # flame's per-step seed (dropout)
        for group in optimizer.param_groups:
            group["lr"] = step["lr"]
        optimizer.zero_grad()
        total = 0.0
        for ids, positions, labels, count in step["batches"]:
            logits = model(input_ids=ids, position_ids=positions).logits
            loss = cross_entropy_sum(logits, labels) / count
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, job.training.max_norm, foreach=True)
        optimizer.step()
        losses.append(total)
    return losses, logits_on_fixed_ids(model)


if __name__ == "__main__":
    base_dir, out = sys.argv[1], sys.argv[2]
    init_logger()  # flame's log lines, as flame.train prints them
    trainer = RecordingTrainer(prepared(sys.argv[3:]))
    try:
        trainer.train()
        flame_logits = logits_on_fixed_ids(trainer.model_parts[0])
        peft_losses, peft_logits = train_peft(base_dir, trainer)
        torch.save({
            "flame_losses": [step["loss"] for step in trainer.steps], "peft_losses": peft_losses,
            "start": trainer.start, "flame_logits": flame_logits, "peft_logits": peft_logits,
        }, out)
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()

"""In-loop validation: torchtitan's validator hook, evaluating flame's validation set (flame.data.validation).

torchtitan's training loop asks ``should_validate(step)`` after every step (after its checkpoint)
and calls ``validate(model_parts, step)``; flame's Trainer also asks once more when the data ran
out before the last step. An evaluation runs the model in eval mode under no_grad over this
rank's share of the fixed validation set, computed as training computes its batches (documents,
context-parallel share, fused loss head: flame.models.inputs.batch_inputs; under pipeline
parallelism torchtitan's schedule in eval mode, whose loss is each microbatch's summed loss).
Summed losses, target counts and bytes are added up over the ranks (never averages of
averages), so every target counts once. Training is untouched: no state of the training data,
no RNG draw (dropout is off in eval mode), and the model goes back to train mode with its FSDP
weights resharded as they were.

Metrics, per source (``validation/<source>/...``, the names of the data/<source>/ metrics) and
over all sources (``validation/...``): loss (nats per target token), ppl (exp of it), bpb (bits
per UTF-8 byte of the targets' text: summed loss / ln 2 / bytes, flame.data.validation.token_bytes),
tokens, and time_s for the whole evaluation.
"""

import math
import time

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.validate import BaseValidator
from torchtitan.tools.logging import logger

from flame.base import batch_context, device
from flame.base.batch_context import BatchContext
from flame.data.validation import ValidationSet
from flame.distributed.context_parallel import ContextParallel
from flame.models.inputs import batch_inputs, to_device


class Validator(BaseValidator):
    """Evaluates the validation set every --validation.freq steps and after the last one."""

    def __init__(self, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None,
                 pp_has_first_stage=None, pp_has_last_stage=None):
        super().__init__(job_config)
        self.parallel_dims, self.loss_fn, self.metrics_processor = parallel_dims, loss_fn, metrics_processor
        self.validation_context, self.maybe_enable_amp = validation_context, maybe_enable_amp
        self.pp_schedule, self.pp_has_first_stage, self.pp_has_last_stage = pp_schedule, pp_has_first_stage, pp_has_last_stage
        self.context_parallel = ContextParallel.of_run(parallel_dims, job_config)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device.CUDA else torch.device("cpu")
        self.set = ValidationSet.build(job_config, tokenizer, dp_rank, dp_world_size)
        self.last_step: int | None = None  # the step last evaluated
        self.ema = None  # the weights' average (flame.training.ema), scored after the live weights when set
        if dp_rank == 0:
            logger.info(
                f"Validation: {', '.join(self.set.names)}, {len(self.set.batches)} batches per data-parallel rank of "
                f"{job_config.validation.local_batch_size} x {job_config.validation.seq_len} tokens, every "
                f"{job_config.validation.freq} steps and after the last"
            )

    def should_validate(self, step: int) -> bool:
        return step % self.job_config.validation.freq == 0 or step == self.job_config.training.steps

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        if step == self.last_step:
            return
        self.last_step = step
        self._score(model_parts, step)
        if self.ema is not None:
            with self.ema.swapped_in():
                self._score(model_parts, step, "ema_")

    def _score(self, model_parts: list[nn.Module], step: int, weights: str = "") -> None:
        """Evaluate the set with the weights the model holds now; log it (``weights``: _log's)."""
        start = time.perf_counter()
        for model in model_parts:
            model.eval()
        losses = torch.zeros(len(self.set.names), dtype=torch.float64, device=self.device)
        try:
            for batch in self.set.batches:
                inputs = to_device(batch.inputs, self.device)
                loss = self._summed_loss(model_parts, inputs, batch.labels.to(self.device))
                if batch.source >= 0:
                    losses[batch.source] += loss.double()
        finally:
            for model in model_parts:
                model.train()
                # FSDP keeps the weights that training's backward would reshard gathered: free them as training would
                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
        seconds = time.perf_counter() - start
        self.metrics_processor.time_last_log += seconds  # the next training line's tokens/s and MFU leave it out
        self._log(step, self._reduce(losses), seconds, weights)

    def _summed_loss(self, model_parts: list[nn.Module], inputs: dict, labels: torch.Tensor) -> torch.Tensor:
        """This rank's summed loss of one batch (its CP share; 0 on pipeline stages without the loss)."""
        if self.parallel_dims.pp_enabled:
            # the schedule's loss divides by the step's target count (flame.distributed.pipeline): 1 keeps sums
            step = BatchContext(global_valid_tokens=torch.ones((), device=self.device))
            losses = [] if self.pp_has_last_stage else None
            first = (inputs["input"],) if self.pp_has_first_stage else ()
            with self.validation_context(), batch_context.computing(step):
                self.pp_schedule.eval(
                    *first, position_ids=inputs["position_ids"].cpu(), labels=labels,
                    target=labels if self.pp_has_last_stage else None, losses=losses, return_outputs=False,
                )
            return torch.stack(losses).sum().to(self.device) if self.pp_has_last_stage else torch.zeros((), device=self.device)
        model = model_parts[0]
        ids, labels, kwargs, context = batch_inputs(model, inputs, labels, BatchContext(), self.context_parallel)
        with self.validation_context(), batch_context.computing(context), self.maybe_enable_amp:
            return self.loss_fn(model(ids, **kwargs), labels).detach()

    def _reduce(self, losses: torch.Tensor) -> torch.Tensor:
        """[source, (summed loss, targets, bytes)] over the whole set: every rank's share added once."""
        dims = self.parallel_dims
        # a data-parallel rank's loss lies on its last pipeline stage, spread over its context-parallel ranks
        for name, enabled in (("pp", dims.pp_enabled), ("cp", dims.cp_enabled)):
            if enabled:
                torch.distributed.all_reduce(losses, group=dims.get_mesh(name).get_group())
        counts = torch.from_numpy(np.stack([self.set.tokens, self.set.bytes], axis=1)).to(self.device, torch.float64)
        totals = torch.cat([losses[:, None], counts], dim=1)
        if dims.dp_enabled:
            torch.distributed.all_reduce(totals, group=dims.get_mesh("batch").get_group())
        return totals.cpu()

    def _log(self, step: int, totals: torch.Tensor, seconds: float, weights: str = "") -> None:
        """Log the set's scores: validation/loss (ppl, bpb, tokens), per source when several; ``weights`` prefixes the
        names of another set of weights' scores (``ema_``: validation/ema_loss ...)."""
        metrics = {}
        for prefix, (loss, tokens, nbytes) in [("validation", totals.sum(0).tolist()),
                                               *((f"validation/{name}", row) for name, row in zip(self.set.names, totals.tolist()))]:
            if prefix != "validation" and len(self.set.names) == 1:
                break  # one source: the overall numbers are its own
            mean = loss / tokens if tokens else float("nan")
            metrics |= {f"{prefix}/{weights}loss": mean, f"{prefix}/{weights}ppl": math.exp(min(mean, 700)),
                        f"{prefix}/{weights}bpb": loss / math.log(2) / nbytes if nbytes else float("nan"),
                        f"{prefix}/{weights}tokens": int(tokens)}
        metrics[f"validation/{weights}time_s"] = seconds
        self.metrics_processor.logger.log(metrics, step)
        per_source = "".join(f"  {name} {metrics[f'validation/{name}/{weights}loss']:.4f}" for name in self.set.names
                             if f"validation/{name}/{weights}loss" in metrics)
        which = " (EMA weights)" if weights else ""
        logger.info(
            f"validate step {step}{which}  loss {metrics[f'validation/{weights}loss']:7.4f}  ppl "
            f"{metrics[f'validation/{weights}ppl']:.2f}  bpb {metrics[f'validation/{weights}bpb']:.4f}  tokens "
            f"{metrics[f'validation/{weights}tokens']:,}  {seconds:.1f}s{per_source}"
        )


def build_validator(job_config, **kwargs) -> Validator:
    """torchtitan TrainSpec hook (build_validator_fn)."""
    return Validator(job_config, **kwargs)

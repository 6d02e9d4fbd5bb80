"""flame's Trainer: torchtitan's Trainer with the few hooks an HF/fla causal LM needs.

torchtitan builds everything from the "flame" TrainSpec registered below (HF model from a
config JSON, generic FSDP/AC/compile, flame's data loader, loss, metrics, and optimizers with
Muon among them: flame.optim.builder; the validator: flame.training.validation,
which torchtitan's loop calls after each step's checkpoint). flame overrides:
- ``forward_backward_step``: the model gets the inputs its family understands (under context
  parallelism, this rank's share of the tokens: flame.distributed.context_parallel), and runs
  forward and backward inside its batch's context (flame.base.batch_context: documents, targets,
  loss normalization); under pipeline parallelism the schedule gets each stage's document
  and label inputs;
- ``train``: a final checkpoint (and evaluation, with --validation.enable) when the data ran out,
  keep_latest_k also after the final save; on a stop signal (flame.training.stop), every rank finishes
  the same step and the run saves it; a last step that could not be saved stops the run in one line
  (an interval save that fails is only a warning: flame.checkpoint.save_failures);
- ``should_continue_training``: first asked once the checkpoint is loaded, when the run is known
  to start: numbers the attempt and records its job config (flame.base.dump_folder); no further
  step after a stop signal;
- ``train_step``: the micro-batches of the step and a data phase's optimizer reset (flame.training.curriculum),
  per-step RNG, ranks agreeing on running out of data, the update taken or
  skipped (flame.training.update_guard: non-finite gradients, loss spikes), richer metrics
  (per-source data counts among them); the Nsight Systems window and NVTX ranges
  (flame.training.nsys); under LoRA, the first step checks that every adapter got a
  gradient (flame.models.lora);
- ``state_dict``: the train state also counts skipped steps and holds the spike window;
- ``close``: a finished run waits for the background evaluations of its saved steps
  (--eval.tasks, flame.training.evaluation); a failed one stops them.
flame's changes to other libraries apply first (flame.compat); the log lists them in one line.
"""

import contextlib
import os
from typing import Any

import torch
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.train_spec import (
    TrainSpec,
    get_train_spec,
    register_train_spec,
)
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer as TorchtitanTrainer

from flame.base import batch_context, device, progress
from flame.training.curriculum import StepCurriculum
from flame.training.ema import WeightAverage

from flame import compat, memory

from flame.base.batch_context import BatchContext
from flame.checkpoint.manager import FlameCheckpointManager
from flame.checkpoint.steps import EMA_STATE
from flame.checkpoint.steps import complete_steps
from flame.training import evaluation
from flame.models.loss import build_loss
from flame.training.metrics import LossTermsWindow, build_metrics_processor, data_metrics
from flame.training.nsys import NsysWindow
from flame.training import side_outputs, stop
from flame.optim.builder import build_lr_schedulers, build_optimizers
from flame.optim.streamed_adamw import StreamedOptimizersContainer
from flame.training.update_guard import UpdateGuard
from flame.training.validation import build_validator
from flame.data.loader import build_dataloader
from flame.data.tokenizer import load_tokenizer
from flame.distributed import degrees
from flame.distributed.context_parallel import ContextParallel
from flame.distributed.parallelize import parallelize_model
from flame.distributed.pipeline import pipeline_model
from flame.base.dump_folder import ATTEMPTS, next_attempt, record_attempt
from flame.models import float8, lora, moe
from flame.models.builder import AnyFlavor, build_model
from flame.models.inputs import batch_inputs, to_device


def register_flame_train_spec() -> None:
    try:
        get_train_spec("flame")
        return
    except ValueError:
        pass
    register_train_spec(
        "flame",
        TrainSpec(
            model_cls=build_model,
            model_args=AnyFlavor(),
            parallelize_fn=parallelize_model,
            pipelining_fn=pipeline_model,
            build_optimizers_fn=build_optimizers,
            build_lr_schedulers_fn=build_lr_schedulers,
            build_dataloader_fn=build_dataloader,
            build_tokenizer_fn=lambda job_config: load_tokenizer(job_config.model.tokenizer_path),
            build_loss_fn=build_loss,
            build_metrics_processor_fn=build_metrics_processor,
            build_validator_fn=build_validator,
        ),
    )


class Trainer(TorchtitanTrainer):
    def __init__(self, job_config):
        # installed by flame.train first of all: a signal while building stops the run before step 1
        self.stop_signals = stop.signals()
        self.step_notes = progress.StepNotes(int(os.environ.get("RANK", "0")))  # names a hung rank if the run fails
        side_outputs.make_folders(job_config)  # a trace folder that cannot be made turns its output off, with a warning
        self.stopping = False  # all ranks agreed to stop after the current step
        self.first_step = 1  # this attempt's first step, once the checkpoint loaded
        compat.apply(job_config, FlameCheckpointManager)  # before torchtitan's Trainer picks its device
        register_flame_train_spec()
        self.data_exhausted = False
        self.adapters_unchecked = job_config.lora.rank is not None  # until the first backward (lora.check_gradients)
        self._loss_window: torch.Tensor | None = None
        self.curriculum = StepCurriculum(job_config)  # batch ramp, data phases' optimizer resets and lr restarts
        self.loss_terms = LossTermsWindow(job_config.training.z_loss > 0)  # z-loss, a MoE's router loss and load
        self._window_steps = 0
        self.nsys = NsysWindow(job_config.profiling.nsys_start_step, job_config.profiling.nsys_stop_step)
        super().__init__(job_config)
        self.streamed = isinstance(self.optimizers, StreamedOptimizersContainer)  # --memory.stream_weights
        if degrees.fsdp_alone(job_config, self.parallel_dims.world_size) or self.streamed:
            # FSDP over one rank computes in bf16 already (streamed weights come in it; torchtitan leaves mixed
            # precision to FSDP only over several ranks): autocast would add float32 norms and residuals
            self.maybe_enable_amp = contextlib.nullcontext()
            if getattr(self, "validator", None) is not None:
                self.validator.maybe_enable_amp = self.maybe_enable_amp
        self.updates = UpdateGuard(job_config.training, job_config.optimizer, self.optimizers, self._what_is_saved)
        self.fp8_scales = float8.gathers_in_fp8(float8.Float8Settings.of(job_config.float8), self.parallel_dims.fsdp_enabled)
        self.checkpointer.before_save = self.updates.settle  # the train state counts the skips of every step
        if self.checkpointer.failures is not None:  # a failed save before the last one says which save tries again
            self.checkpointer.failures.last_step = job_config.training.steps
        self.checkpointer.start_from(job_config.model.init_from)  # applied by checkpointer.load, when no step loads
        self.checkpointer.set_identity(job_config, self.tokenizer)  # recorded with every step, for a resume's check
        self.ema = WeightAverage(self.model_parts, job_config.training.ema_decay) if job_config.training.ema_decay else None
        balanced = self.parallel_dims.get_optional_mesh("loss")  # the data x context ranks, whose loads add up
        self.selection_bias = moe.SelectionBias(self.model_parts[0], job_config.training.router_bias_rate,
                                                balanced and balanced.get_group()) if job_config.training.router_bias_rate else None
        if self.ema is not None:  # saved and loaded with the step; validated beside the live weights
            self.checkpointer.states[EMA_STATE] = self.ema
            if getattr(self, "validator", None) is not None:
                self.validator.ema = self.ema
        self.curriculum.shape_lr(self.lr_schedulers)  # before a checkpoint loads: its lrs are computed with it
        self.context_parallel = ContextParallel.build(self.model_parts[0], self.parallel_dims, job_config)
        logger.info(compat.describe())  # all of them applied by now: the model (and fla) exists
        self.metrics_processor.model_flops = self.model_args.flops
        logger.info(self.metrics_processor.describe_mfu())
        if job_config.memory.plan == "auto" and torch.distributed.get_world_size() > 1:
            memory.check_same_plan(job_config)
        if device.CUDA and job_config.memory.plan == "auto" and torch.distributed.get_rank() == 0:
            self.metrics_processor.planned_gib = memory.planned_gpu_gib(job_config, torch.distributed.get_world_size())
        self.attempt: int | None = None  # numbered once the run is known to start (start_attempt)
        self.evaluations = evaluation.build(job_config, self.checkpointer, logger)  # --eval.tasks, rank 0
        self.finished = False

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        """This rank's loss (summed over its targets, divided by the step's global count), after its backward."""
        step = BatchContext(global_valid_tokens=global_valid_tokens)
        if self.parallel_dims.pp_enabled:
            return self._pipeline_forward_backward(step, input_dict, labels)
        model = self.model_parts[0]
        inputs, labels, kwargs, batch = batch_inputs(model, input_dict, labels, step, self.context_parallel)
        with self.train_context(), batch_context.computing(batch):
            with self.maybe_enable_amp, self.nsys.range("forward"):
                # the output (all logits, unless fused) is freed before the backward
                loss = self.loss_fn(model(inputs, **kwargs), labels) / global_valid_tokens
            with self.nsys.range("backward"):
                loss.backward()
        return loss

    def _pipeline_forward_backward(self, step: BatchContext, input_dict, labels) -> torch.Tensor:
        # Every stage gets the position ids (its documents) and the labels (the last stage's
        # fused loss); the schedule splits them into microbatches like the inputs, and its loss
        # divides by the step's global target count (flame.distributed.pipeline.TokenNormalizedLoss).
        losses = [] if self.pp_has_last_stage else None
        inputs = (input_dict["input"],) if self.pp_has_first_stage else ()
        with self.train_context(), batch_context.computing(step), self.nsys.range("forward_backward"):
            self.pp_schedule.step(
                *inputs,
                position_ids=input_dict["position_ids"],
                labels=labels,
                target=labels if self.pp_has_last_stage else None,
                losses=losses,
                return_outputs=False,
            )
        if not self.pp_has_last_stage:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().to(self.device)  # each microbatch's loss is already over the global count

    def train(self) -> None:
        super().train()
        self.updates.settle(ended=not self.stopping and self.step - self.data_exhausted)  # and did the run train?
        self.nsys.close()  # the run ended inside the window
        if self.data_exhausted:  # the loop stopped inside a step it counted but did not take
            self.step -= 1
            self.checkpointer.save(self.step, last_step=True)
            if self.job_config.validation.enable:  # the last step taken is the run's last: evaluated like one
                self.validator.validate(self.model_parts, self.step)
        self.stopping &= not self.data_exhausted and self.step < self.job_config.training.steps  # else it ended anyway
        if self.stopping:
            stop.save_the_stopped_step(self.checkpointer, self.step, self.first_step, self.stop_signals.received,
                                       self.job_config.job.dump_folder)
        elif self.checkpointer.failures is not None:  # the last save: no later one makes up for it
            self.checkpointer.failures.check_the_last_save(self.step, self.checkpointer.recorder)
        if self.checkpointer.enable:  # torchtitan's final save does not apply keep_latest_k
            compat.torchtitan.purge_stale_checkpoints(self.checkpointer)
        self.finished = not self.stopping

    def close(self) -> None:
        if getattr(self, "evaluations", None) is not None:  # a finished run waits for its last steps' scores
            if self.finished:
                self.checkpointer.recorder.wait()  # the last manifest, which queues the last evaluation
            self.evaluations.close(wait=self.finished)
        super().close()

    def should_continue_training(self) -> bool:
        if self.attempt is None:  # first asked right after the checkpoint loaded: the run starts
            self.first_step = self.step + 1
            self.start_attempt()
            signalled = torch.tensor(int(self.stop_signals.received is not None), device=self.device)
            self.stopping = self._any_rank_stops(signalled, reduced_over=1)  # signalled while building
        return not self.stopping and super().should_continue_training()

    def _any_rank_stops(self, signalled: torch.Tensor, reduced_over: int) -> bool:
        """Whether any rank got a stop signal, from ``signalled``: this rank's flag summed over ``reduced_over`` ranks
        (its data-parallel group, in the step's batch reduction); the others' flags are added here."""
        if torch.distributed.get_world_size() == 1:
            return self.stop_signals.received is not None
        if reduced_over < torch.distributed.get_world_size():
            # TP, CP or pipeline ranks beside the data-parallel ones (or none reduced yet): one more tiny reduction
            signalled = signalled.clone()
            torch.distributed.all_reduce(signalled)
        return bool(signalled.item())

    def start_attempt(self) -> None:
        """Number this start of the run among the dump folder's attempts and record its job config (rank 0).

        Not before: a run that fails while building or loading leaves the job config of the
        folder's last run that started, from which its checkpoints are exported, as it was.
        """
        self.attempt = 0  # only rank 0 writes what the number goes in
        if torch.distributed.get_rank() != 0:
            return
        dump_folder = self.job_config.job.dump_folder
        # train.sh's launcher numbered it under the dump folder's lock; a bare torchrun launch did not
        self.attempt = int(os.environ.get("FLAME_ATTEMPT") or next_attempt(dump_folder))
        record_attempt(dump_folder, self.attempt, self.job_config.to_dict())
        self.metrics_processor.jsonl.attempt = self.attempt
        logger.info(f"Attempt {self.attempt} in {dump_folder}: job config in {ATTEMPTS}/{self.attempt}/")

    def _next_microbatches(self, data_iterator) -> tuple[list, torch.Tensor, torch.Tensor]:
        """This step's micro-batches, their real-target count, and the count over all data-parallel ranks.

        All ranks agree (in the same reduction) on whether any ran out of data, so that they all
        stop together instead of some waiting forever in a collective.
        """
        microbatches, exhausted = [], False
        try:
            for _ in range(self.gradient_accumulation_steps):
                microbatches.append(next(data_iterator))
        except DataloaderExhaustedError:
            exhausted = True
        local_valid = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches) if not exhausted else 0
        self.step_notes.starts(self.step)  # before the step's first collective: a rank that never gets here is named
        signalled = int(self.stop_signals.received is not None)  # agreed in the same reduction: no collective of its own
        # from pinned memory without waiting: a plain copy to the GPU would wait for the previous step's kernels
        counts = torch.tensor([local_valid, int(exhausted), signalled], dtype=torch.int64, pin_memory=device.CUDA)
        counts = counts.to(self.device, non_blocking=True)
        local_valid_tokens = counts[0].clone()
        if self.parallel_dims.dp_enabled:
            torch.distributed.all_reduce(counts, group=self.parallel_dims.get_mesh("batch").get_group())
            exhausted = bool(counts[1].item())
        batch_ranks = self.parallel_dims.get_mesh("batch").size() if self.parallel_dims.dp_enabled else 1
        self.stopping = self._any_rank_stops(counts[2], batch_ranks)
        if exhausted:
            self.data_exhausted = True
            raise DataloaderExhaustedError()
        return microbatches, local_valid_tokens, counts[0].float()

    def train_step(self, data_iterator) -> None:
        with self.nsys.step(self.step):
            self._train_step(data_iterator)

    def _train_step(self, data_iterator) -> None:
        if self.metrics_processor.step_last_log is None:  # first step of this process (maybe resumed)
            self.metrics_processor.step_last_log = self.step - 1
        self.optimizers.zero_grad()
        self.gradient_accumulation_steps = self.curriculum.accumulation(self.step)
        if self.streamed:  # its gradients come down pass by pass, summed on the host when there are several
            self.optimizers.begin_step(self.gradient_accumulation_steps)
        self.curriculum.before_step(self.step, self.optimizers)
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        # Randomness (e.g. dropout) is a function of (seed, step): a resumed run draws the same.
        torch.manual_seed((self.job_config.debug.seed or 0) * 1_000_003 + self.step)

        with self.nsys.range("data"):
            microbatches, local_valid_tokens, global_valid_tokens = self._next_microbatches(data_iterator)

        losses = []
        # pipeline stages find each microbatch's documents in its position ids, read on the CPU
        on_cpu = frozenset({"position_ids"} if self.parallel_dims.pp_enabled else ())
        for input_dict, labels in microbatches:
            input_dict = to_device(input_dict, self.device, on_cpu)
            bounds = input_dict["cu_seqlens_host"]  # read on the CPU: no sync
            documents = [end - start for start, end in zip(bounds, bounds[1:])]
            self.metrics_processor.flops_since_last_log += self.model_args.flops.batch_flops(documents)
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=labels.to(self.device, non_blocking=True), global_valid_tokens=global_valid_tokens
            )
            losses.append(loss.detach())
        if self.adapters_unchecked:
            lora.check_gradients(self.model_parts, self.device, getattr(self.optimizers, "graded", None))
            self.adapters_unchecked = False

        self.nsys.push("optimizer")  # to the schedule's step, with the clipping and the update
        # streamed, the gradients are on the host, their norm summed as they came down
        grad_norm = self.optimizers.clip_grad_norm_(self.job_config.training.max_norm) if self.streamed else (
            dist_utils.clip_grad_norm_(
                [p for model in self.model_parts for p in model.parameters()],
                self.job_config.training.max_norm,
                foreach=True,
                pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
                ep_enabled=self.parallel_dims.ep_enabled,  # the experts' norm over their own ranks
            ))
        step_loss = torch.stack(losses).sum()
        self.updates.step(self.step, grad_norm, global_loss=lambda: self._reduce_loss(step_loss)[1],
                          targets=global_valid_tokens, before_update=self.checkpointer.maybe_wait_for_staging)
        if self.fp8_scales:  # the next forward's FSDP all-gathers read them
            float8.precompute_scales(self.model_parts)
        self.lr_schedulers.step()
        if self.ema is not None:
            self.ema.update()
        self.nsys.pop()

        # The logged loss is the mean over the steps since the last log line (a smooth curve
        # even when logging every N steps); accumulated on device, so no sync per step.
        self._loss_window = step_loss if self._loss_window is None else self._loss_window + step_loss
        counts = self.loss_terms.add(global_valid_tokens, self.device)
        if self.selection_bias is not None and counts is not None:  # after the update: the next step routes by it
            self.selection_bias.update(counts)
        self._window_steps += 1
        if not self.metrics_processor.should_log(self.step):
            return
        self.updates.settle()
        loss, global_avg_loss = self._reduce_loss(self._loss_window / self._window_steps)
        batch_mesh = self.parallel_dims.get_optional_mesh("batch") if self.parallel_dims.dp_enabled else None
        terms = self.loss_terms.metrics(self._reduce_loss, self._window_steps, batch_mesh and batch_mesh.get_group())
        self._loss_window, self._window_steps = None, 0
        global_max_loss = dist_utils.dist_max(loss * global_valid_tokens / local_valid_tokens, batch_mesh)
        tokens_seen = int(dist_utils.dist_sum(torch.tensor(self.ntokens_seen, device=self.device), batch_mesh))
        spikes = self.updates.spikes.metrics() if self.updates.spikes.enabled else {}
        self.metrics_processor.log(
            self.step,
            global_avg_loss.item(),
            global_max_loss,
            grad_norm.item(),
            extra_metrics={
                "lr": lr, "n_tokens_seen": tokens_seen, "skipped_steps": self.updates.skipped_steps, **spikes, **terms,
                **data_metrics(self.dataloader, self.parallel_dims, self.device),
            },
        )

    def _reduce_loss(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this data-parallel rank's share of ``loss``, the sum over all of them), as tensors: no host sync.

        ``loss`` is this rank's part of a loss divided by the global target count, so the sum over
        the data-parallel ranks is the step's loss; every rank gets the same sum.
        """
        loss = loss.detach().clone()  # reduced in place, and the caller may keep the original
        if self.parallel_dims.pp_enabled:  # the last stage holds the loss, the others 0
            torch.distributed.all_reduce(loss, group=self.parallel_dims.get_mesh("pp").get_group())
        if self.parallel_dims.cp_enabled:  # a data-parallel rank's loss is spread over its CP ranks
            torch.distributed.all_reduce(loss, group=self.parallel_dims.get_mesh("cp").get_group())
        total = loss.clone()
        # over the data-parallel ranks (every CP, TP or pipeline rank of one holds the same batch)
        if self.parallel_dims.dp_enabled:
            torch.distributed.all_reduce(total, group=self.parallel_dims.get_mesh("batch").get_group())
        return loss, total

    def _what_is_saved(self) -> str:
        """What a run stopping now leaves: its last complete checkpoint, or none."""
        if self.checkpointer.recorder is not None:  # the last save's manifest, which makes its step complete
            self.checkpointer.recorder.wait()
        steps = complete_steps(os.path.join(self.job_config.job.dump_folder, self.job_config.checkpoint.folder))
        return f"step-{steps[-1]}, the last checkpoint, is intact" if self.checkpointer.enable and steps else "no checkpoint was saved"

    def state_dict(self) -> dict[str, Any]:
        # ntokens_seen as the run's total (torchtitan saves rank 0's own count), so that another layout resumes it
        tokens = self.ntokens_seen
        if self.parallel_dims.dp_enabled:
            tokens = int(dist_utils.dist_sum(torch.tensor(tokens, device=self.device), self.parallel_dims.get_mesh("batch")))
        return {
            **super().state_dict(), "ntokens_seen": tokens, **self.updates.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.updates.load_state_dict(state_dict)
        # the total carries on in the first data-parallel rank's count; the log sums them
        if self.parallel_dims.dp_enabled and self.parallel_dims.get_mesh("batch").get_local_rank() != 0:
            self.ntokens_seen = 0

"""The trainer's side of the curriculum (flame.config.curriculum): the micro-batches each step takes under a batch
ramp, the optimizer state reset at the start of a data phase that asks for it, and the lr factor (a data phase's
restart of the schedule, the lr following the batch). The data side (context length, mixture) is in the rows the
loader makes for each step (flame.data.packing).

Everything here is a function of the step, so a resumed run takes the same micro-batches and lrs as an
uninterrupted one; a phase's optimizer reset is in the state of every checkpoint saved after it.
"""

from dataclasses import replace

import torch
from torchtitan.tools.logging import logger

from flame.config.curriculum import Curriculum
from flame.optim.builder import schedule, set_lr

POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}  # --training.lr_follows_batch


class StepCurriculum:
    """The curriculum of a prepared job as the trainer applies it: ``accumulation(step)``, ``before_step`` (the log
    lines of a change, a phase's optimizer reset) and ``shape_lr`` (once, before a checkpoint loads)."""

    def __init__(self, job_config):
        t = job_config.training
        self.curriculum = Curriculum.of(t)
        self.global_rows = t.global_batch_size  # of the largest step (flame.prepare.batch)
        self.per_microbatch = t.global_batch_size // t.gradient_accumulation_steps  # rows over all ranks
        self.power = POWERS[t.lr_follows_batch]
        self.lr_scheduler, self.training_steps = job_config.lr_scheduler, t.steps
        for phase in self.curriculum.phases:
            if phase.start > t.steps:
                logger.warning(f"--training.data_phases: the phase from step {phase.start} starts after this run's "
                               f"last step ({t.steps}) and changes nothing in it")

    def accumulation(self, step: int) -> int:
        """Micro-batches a rank takes for ``step``."""
        return self.curriculum.rows(step, self.global_rows) // self.per_microbatch

    def before_step(self, step: int, optimizers) -> None:
        """At ``step``'s start: log what changes at it, and reset the optimizer state where a data phase starts so."""
        c = self.curriculum
        if c.batch and step in {first for first, _ in c.batch} and step > 1:
            logger.info(f"Batch ramp: {c.rows(step, 0)} rows a step from step {step} "
                        f"({self.accumulation(step)} micro-batches a rank)")
        if c.context and step in {first for first, _ in c.context} and step > 1:
            logger.info(f"Context ramp: documents cut to at most {c.context_len(step, 0)} tokens from step {step}")
        phase = next((phase for phase in c.phases if phase.start == step), None)
        if phase is None:
            return
        logger.info(f"Data phase {c.phase(step)} from step {step}: mixture {list(phase.probabilities)}"
                    f"{', optimizer state reset' if phase.reset_optimizer else ''}"
                    f"{', lr schedule restarted' if phase.restart_lr else ''}")
        if phase.reset_optimizer:
            reset_state(optimizers)

    def shape_lr(self, lr_schedulers) -> None:
        """Make every scheduler's factor the curriculum's: a restarted schedule from a data phase that restarts it,
        times (rows / the largest batch's) ^ power; the lrs of the current step set from it."""
        c = self.curriculum
        restarts = [phase.start for phase in c.phases if phase.restart_lr]
        if not restarts and not self.power:
            return
        total = self.lr_scheduler.total_steps or self.training_steps
        unbounded = replace(self.lr_scheduler, total_steps=None)
        restarted = {start: schedule(unbounded, max(1, total - start + 1)) for start in restarts}
        largest = c.largest_batch() or self.global_rows

        def shaped(original):
            def factor(done: int) -> float:  # ``done`` steps taken: the factor of step done + 1
                step = done + 1
                start = max((s for s in restarts if s <= step), default=None)
                base = original(done) if start is None else restarted[start](step - start)
                return base * (c.rows(step, self.global_rows) / largest) ** self.power
            return factor

        for scheduler in lr_schedulers.schedulers:
            scheduler.lr_lambdas = [shaped(original) for original in scheduler.lr_lambdas]
            lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                set_lr(group, lr)
            scheduler._last_lr = lrs


def reset_state(optimizers) -> None:
    """Every optimizer's state back to its start, in place: the moments and step counts of AdamW, Muon and the
    optimizer on the host start at zero, so zeros are a fresh start (and the memory stays where it is)."""
    if hasattr(optimizers, "settle"):  # the optimizer on the host may still be updating the last step's weights
        optimizers.settle()
    for optimizer in optimizers.optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.zero_()
                elif isinstance(value, (int, float)):
                    state[key] = type(value)(0)

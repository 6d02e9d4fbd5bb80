"""Whether a step's update is taken: a finite gradient norm and, under --training.spike_sigma, no spike.

A step whose gradient norm is NaN or Inf has its update skipped (--training.skip_nan_inf) or
stops the run; a spike (flame.training.spikes) is always skipped. Skips have a limit
(--training.max_skipped_steps): a run whose updates keep failing has diverged, and one more
skip stops it, naming the last intact checkpoint.

Where the check runs. Reading the gradient norm on the host makes the step wait for its whole
backward: the GPU then idles while the host queues the update and the next step's first kernels.
With an optimizer whose record says it skips on the GPU (flame.optim.record's ``skips_on_gpu``:
fused Adam or AdamW, torchtitan's default implementation) the check stays on the GPU: the
optimizer skips the update itself when the norm is not finite (its ``found_inf`` input, as
under a gradient scaler), leaving the weights, moments and step count as they were, and the
norms are read later, where the host waits anyway: at log steps, before a checkpoint is saved
(its train state counts the skips) and at the end of the run. The decisions are then taken for
each of those steps in turn, as they would have been at the step itself, so the counts, warnings
and the step a stop names are the same; a run that must stop stops before anything of the later
steps is saved. Other optimizers (Muon, the host optimizer, foreach or for-loop Adam) and the
spike policy, which judges on the host, check at every step.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torchtitan.tools.logging import logger

from flame.base.errors import UpdatesFailingError
from flame.optim.record import optimizer_record
from flame.training.spikes import SpikeWindow


class UpdateGuard:
    """The skip-or-stop policy of a run's updates, and its counts (part of the train state)."""

    def __init__(self, training, optimizer, optimizers, saved: Callable[[], str]):
        """``training``, ``optimizer``: the job's training and optimizer sections; ``optimizers``: torchtitan's
        container built from the latter; ``saved``: what survives a stop now (``step-N, the last checkpoint, is
        intact``)."""
        self.skip_nan_inf, self.limit = training.skip_nan_inf, training.max_skipped_steps
        self.spikes = SpikeWindow(training.spike_sigma, training.spike_window, training.spike_min_steps)
        self.optimizers, self.saved = optimizers, saved
        self.deferred = not self.spikes.enabled and optimizer_record(optimizer.name).skips_on_gpu(optimizer)
        self.unread: list[tuple[int, torch.Tensor]] = []  # (step, gradient norm) not yet judged
        self.skipped_steps = 0
        self.consecutive_skips = 0  # updates skipped in a row

    def step(self, step: int, grad_norm: torch.Tensor, global_loss: Callable[[], torch.Tensor],
             before_update: Callable[[], None]) -> None:
        """Take step ``step``'s update unless its gradient norm (global, every rank's alike) or its loss
        (``global_loss()``, asked only under the spike policy) says otherwise; ``before_update`` runs
        right before an update."""
        if self.deferred:
            found_inf = torch.logical_not(torch.isfinite(grad_norm)).float()
            for optimizer in self.optimizers.optimizers:
                optimizer.found_inf = found_inf  # read by fused Adam's step, which then skips on the GPU
            self.unread.append((step, grad_norm.detach()))
            before_update()
            self.optimizers.step()
            return
        if self._sound(step, grad_norm, global_loss):
            self.consecutive_skips = 0
            before_update()
            self.optimizers.step()

    def settle(self) -> None:
        """Judge the steps whose gradient norms the GPU kept (one host wait for all of them): count and
        warn about their skipped updates, or stop the run at the first step that had to."""
        if not self.unread:
            return
        steps = [step for step, _ in self.unread]
        norms = torch.stack([norm.float() for _, norm in self.unread]).tolist()
        self.unread = []
        for step, norm in zip(steps, norms):
            if math.isfinite(norm):
                self.consecutive_skips = 0
            else:
                self._skip_or_stop(step, f"gradient norm is {norm}", spike=False)

    def _sound(self, step: int, grad_norm: torch.Tensor, global_loss: Callable[[], torch.Tensor]) -> bool:
        # one host wait: with the spike policy the step's global loss comes in the same transfer
        if not self.spikes.enabled:
            if torch.isfinite(grad_norm):
                return True
            self._skip_or_stop(step, f"gradient norm is {grad_norm.item()}", spike=False)
            return False
        loss, norm = torch.stack([global_loss().float(), grad_norm.float()]).tolist()
        if not math.isfinite(norm):
            self._skip_or_stop(step, f"gradient norm is {norm}", spike=False)
            return False
        if (spike := self.spikes.judge(loss, norm)) is None:
            return True
        self._skip_or_stop(step, spike, spike=True)
        return False

    def _skip_or_stop(self, step: int, problem: str, spike: bool) -> None:
        skips = spike or self.skip_nan_inf
        if skips and (self.limit == 0 or self.consecutive_skips < self.limit):
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.spikes.skips += int(spike)
            kind = "spike" if spike else "non-finite"
            logger.warning(f"step {step}: {problem}; update skipped ({kind}; {self.skipped_steps} skipped so far)")
            self.optimizers.zero_grad()
            return
        if skips:
            spikes = " or raise --training.spike_sigma" if self.spikes.enabled else ""
            raise UpdatesFailingError(
                f"step {step}: {problem}; {self.limit + 1} updates in a row could not be taken (loss spikes or "
                f"non-finite gradients; --training.max_skipped_steps {self.limit}): stopping, {self.saved()}. The run "
                f"has diverged: lower the learning rate or raise the warmup{spikes}, and resume from the last checkpoint"
            )
        raise UpdatesFailingError(
            f"step {step}: {problem}; stopping, {self.saved()}. Lower the learning rate, or pass "
            "--training.skip_nan_inf to skip such updates"
        )

    def state_dict(self) -> dict[str, Any]:
        # settled already: the trainer settles before every checkpoint save (FlameCheckpointManager.before_save)
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                **self.spikes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.spikes.load_state_dict(state)

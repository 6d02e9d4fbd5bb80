"""Whether a step's update is taken: a finite loss and gradient norm, targets to learn, and, under
--training.spike_sigma, no spike.

A non-finite step — its gradient norm or its loss NaN or Inf, or no target in its whole batch (every
rank's labels masked: a loss of 0/0) — has its update skipped (--training.skip_nan_inf) or stops the
run; a spike (flame.training.spikes) is always skipped. Skips have a limit
(--training.max_skipped_steps): a run whose updates keep failing has diverged, and one more
skip stops it, naming the last intact checkpoint. A run that ends without having taken a single
update trained nothing: its last step stops it (exit 1) instead of being skipped, so that nothing
of it is saved as its result or exported.

Where the check runs. Reading the gradient norm on the host makes the step wait for its whole
backward: the GPU then idles while the host queues the update and the next step's first kernels.
With an optimizer whose record says it skips on the GPU (flame.optim.record's ``skips_on_gpu``:
fused Adam or AdamW, torchtitan's default implementation) the check stays on the GPU: the
optimizer skips the update itself when the norm or the loss is not finite or there are no targets (its
``found_inf`` input, as under a gradient scaler), leaving the weights, moments and step count as they were, and the
norms and losses are read later, where the host waits anyway: at log steps, before a checkpoint is saved
(its train state counts the skips) and at the end of the run. The decisions are then taken for
each of those steps in turn, as they would have been at the step itself, so the counts, warnings
and the step a stop names are the same; a run that must stop stops before anything of the later
steps is saved. Other optimizers (Muon, the host optimizer, foreach or for-loop Adam) and the
spike policy, which judges on the host, check at every step, in the one host wait they had for the
gradient norm alone. The loss checked is the step's global one (every data-parallel rank's share
summed: a collective, not a host wait), so that every rank takes the same decision.
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
        self.last_step = training.steps  # a run that reaches it without one update taken trained nothing
        self.spikes = SpikeWindow(training.spike_sigma, training.spike_window, training.spike_min_steps)
        self.optimizers, self.saved = optimizers, saved
        self.deferred = not self.spikes.enabled and optimizer_record(optimizer.name).skips_on_gpu(optimizer)
        self.unread: list[tuple[int, torch.Tensor]] = []  # (step, [gradient norm, loss, targets]) not yet judged
        self.skipped_steps = 0
        self.consecutive_skips = 0  # updates skipped in a row

    def step(self, step: int, grad_norm: torch.Tensor, global_loss: Callable[[], torch.Tensor], targets: torch.Tensor,
             before_update: Callable[[], None]) -> None:
        """Take step ``step``'s update unless its gradient norm, its loss (``global_loss()``) or its count of targets
        (``targets``), all three global (every rank's alike), say otherwise; ``before_update`` runs right before an
        update."""
        # on the gradients' device: the host's when FSDP offloads them (--training.enable_cpu_offload), where the
        # fused optimizer reads found_inf beside the weights it steps
        where = grad_norm.device
        measures = torch.stack([grad_norm.detach().float(), global_loss().float().to(where), targets.float().to(where)])
        if self.deferred:
            found_inf = torch.logical_not(torch.isfinite(measures[:2]).all() & (measures[2] > 0)).float()
            for optimizer in self.optimizers.optimizers:
                optimizer.found_inf = found_inf  # read by fused Adam's step, which then skips on the GPU
            self.unread.append((step, measures))
            before_update()
            self.optimizers.step()
            return
        if self._sound(step, *measures.tolist()):  # the step's one host wait
            self.consecutive_skips = 0
            before_update()
            self.optimizers.step()

    def settle(self, ended: int | bool = False) -> None:
        """Judge the steps whose measures the GPU kept (one host wait for all of them): count and warn about their
        skipped updates, or stop the run at the first step that had to. ``ended``: the run's last step, when it
        ends (its data may run out before --training.steps): then a run that took no update stops, before the
        trainer saves that step as its result."""
        steps = [step for step, _ in self.unread]
        read = torch.stack([measures for _, measures in self.unread]).tolist() if self.unread else []
        self.unread = []
        for step, (norm, loss, targets) in zip(steps, read):
            if (problem := _non_finite(norm, loss, targets)) is None:
                self.consecutive_skips = 0
            else:
                self._skip_or_stop(step, problem, spike=False)
        if ended and self.skipped_steps >= ended:
            self._nothing_trained(ended, "the run ends")

    def _sound(self, step: int, norm: float, loss: float, targets: float) -> bool:
        if (problem := _non_finite(norm, loss, targets)) is not None:
            self._skip_or_stop(step, problem, spike=False)
            return False
        if not self.spikes.enabled or (spike := self.spikes.judge(loss, norm)) is None:
            return True
        self._skip_or_stop(step, spike, spike=True)
        return False

    def _nothing_trained(self, step: int, problem: str) -> None:
        fix = _CHECK_THE_DATA if problem == _NO_TARGETS else f"{_CHECK_THE_DATA}, and lower the learning rate"
        raise UpdatesFailingError(
            f"step {step}: {problem}, and every one of the run's {step} updates was skipped: it trained nothing, and "
            f"stops without saving or exporting this step ({self.saved()}). {fix}"
        )

    def _skip_or_stop(self, step: int, problem: str, spike: bool) -> None:
        skips = spike or self.skip_nan_inf
        if skips and step >= self.last_step and self.skipped_steps + 1 >= step:  # a skip that ends the run untrained
            self._nothing_trained(step, problem)
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
            fix = _CHECK_THE_DATA if problem == _NO_TARGETS else (
                f"The run has diverged: lower the learning rate or raise the warmup{spikes}, and resume from the last "
                "checkpoint")
            raise UpdatesFailingError(
                f"step {step}: {problem}; {self.limit + 1} updates in a row could not be taken (loss spikes, or "
                f"non-finite or empty steps; --training.max_skipped_steps {self.limit}): stopping, {self.saved()}. {fix}"
            )
        fix = _CHECK_THE_DATA if problem == _NO_TARGETS else (
            "Lower the learning rate, or pass --training.skip_nan_inf to skip such updates")
        raise UpdatesFailingError(f"step {step}: {problem}; stopping, {self.saved()}. {fix}")

    def state_dict(self) -> dict[str, Any]:
        # settled already: the trainer settles before every checkpoint save (FlameCheckpointManager.before_save)
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                **self.spikes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.spikes.load_state_dict(state)


_NO_TARGETS = "its batch has no targets (every label of every rank masked)"
_CHECK_THE_DATA = ("Check the data: its documents are empty, or tokenize to their delimiters alone (the text column, "
                   "the tokenizer's vocabulary, an SFT source's assistant turns)")


def _non_finite(norm: float, loss: float, targets: float) -> str | None:
    """What makes a step's update unsound, in words; None for a sound one."""
    if targets <= 0:  # its loss is 0/0: NaN, and its gradients, which nothing flowed into, zero
        return _NO_TARGETS
    if not math.isfinite(norm):
        return f"gradient norm is {norm}"
    if not math.isfinite(loss):
        return f"loss is {loss}"
    return None

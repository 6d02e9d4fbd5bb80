"""The loss-spike policy: is a step's loss or gradient norm far above those of the steps before it?

A step whose loss or gradient norm is more than ``sigma`` standard deviations above the mean of
the last ``size`` steps is a spike, and the trainer skips its update (--training.spike_sigma).
The window holds plain floats of every judged step, skipped ones included: a lasting shift of
the loss (a new data source, say) is absorbed within a window instead of being skipped forever.
The values are global (loss over all data-parallel ranks, gradient norm after clipping's
all-reduce), so every rank holds the same window and takes the same decision. The window is
part of the train state: a resumed run judges exactly as an uninterrupted one.
"""

import math
from collections import deque
from typing import Any


def _mean_std(values: deque[float]) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


class SpikeWindow:
    """The last ``size`` steps' loss and gradient norm, and the judgement of a new step against them."""

    def __init__(self, sigma: float, size: int, min_steps: int):
        self.sigma, self.min_steps = sigma, min_steps
        self.losses: deque[float] = deque(maxlen=size)
        self.grad_norms: deque[float] = deque(maxlen=size)
        self.skips = 0  # updates skipped as spikes, over the whole run

    @property
    def enabled(self) -> bool:
        return self.sigma > 0

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a spike (a phrase), or None; either way its values join the window.

        Nothing is judged before the window holds ``min_steps`` steps: the mean and deviation
        of a few steps say little. Non-finite values are not judged here, nor kept (they are the
        non-finite check's, and would make every later mean NaN).
        """
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return None
        reasons = []
        if len(self.losses) >= self.min_steps:
            for name, value, window in (("loss", loss, self.losses), ("gradient norm", grad_norm, self.grad_norms)):
                mean, std = _mean_std(window)
                if value > mean + self.sigma * std:
                    sigmas = (value - mean) / std if std else math.inf
                    reasons.append(f"{name} {value:.4g} is {sigmas:.1f} sigma above the mean {mean:.4g} "
                                   f"of the last {len(window)} steps")
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        return "; ".join(reasons) or None

    def metrics(self) -> dict[str, float]:
        """The skip count and the window's mean and standard deviation, for the metrics log."""
        metrics: dict[str, float] = {"spike_skips": self.skips}
        if self.losses:
            for name, window in (("loss", self.losses), ("grad_norm", self.grad_norms)):
                metrics[f"spike/{name}_mean"], metrics[f"spike/{name}_std"] = _mean_std(window)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        # plain lists of floats: a few hundred numbers in the train state of every checkpoint
        return {"spike_skips": self.skips, "spike_losses": list(self.losses), "spike_grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skips = state["spike_skips"]
        self.losses.clear()
        self.grad_norms.clear()
        self.losses.extend(state["spike_losses"])  # a smaller window now keeps the newest values
        self.grad_norms.extend(state["spike_grad_norms"])

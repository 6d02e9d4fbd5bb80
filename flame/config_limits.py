"""Settings whose values torch or torchtitan would refuse only inside the ranks, after the processes
started (or take silently and train wrong): numbers out of range, NaN or Inf, unknown optimizer
names, settings that act only together with another one. ``check`` refuses them in one line
each, from ``flame.config_manager.finalize``, before any process group exists.
"""

import math
from typing import Any

from flame.errors import ConfigError

OPTIMIZERS = ("Adam", "AdamW", "Muon")  # torchtitan's build_optimizers knows Adam and AdamW; Muon is flame's


def _number(flag: str, value: float, low: float, high: float = math.inf, *, high_open: bool = False,
            meaning: str = "") -> None:
    """``value`` is finite and within [low, high] (or [low, high) with ``high_open``)."""
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or value < low or above:
        bound = f"at least {low:g}" if high == math.inf else f"in [{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{flag} must be a number {bound}{meaning}, got {value}")


def check(config: Any, given: dict[str, int]) -> None:
    """Refuse what torch, torchtitan or flame's trainer cannot run; ``given``: the dotted names the TOML and CLI set."""
    if not config.job.dump_folder.strip():
        raise ConfigError("--job.dump_folder is empty; give the folder for this run's checkpoints and logs (e.g. exp/run)")
    _check_optimizer(config.optimizer, given)
    if config.optimizer.name == "Muon" and config.training.enable_cpu_offload:
        raise ConfigError(
            "--optimizer.name Muon does not combine with --training.enable_cpu_offload: Muon gathers and orthogonalizes "
            "whole matrices on the GPU, and offloaded weights and gradients live on the CPU; leave offload off, or use AdamW"
        )
    _check_nsys_window(config.profiling)
    _check_lr_scheduler(config.lr_scheduler)
    t = config.training
    if math.isnan(t.max_norm):
        raise ConfigError("--training.max_norm is NaN; give the gradient-norm bound, e.g. 1.0")
    loader = t.dataloader
    if "training.dataloader.prefetch_factor" in given or "training.prefetch_factor" in given:
        if loader.num_workers == 0:
            raise ConfigError(
                "--training.prefetch_factor applies to data-loading workers, and there are none: add "
                "--training.num_workers (e.g. 2), or drop --training.prefetch_factor"
            )
        if loader.prefetch_factor is not None and loader.prefetch_factor < 1:
            raise ConfigError(f"--training.prefetch_factor must be >= 1 (batches per worker), got {loader.prefetch_factor}")
    _check_skipping(t, given)
    _check_lora(config, given)


def _check_optimizer(o: Any, given: dict[str, int]) -> None:
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"--optimizer.name {o.name}: flame trains with {', '.join(OPTIMIZERS)}; choose one of them")
    if o.name != "Muon":
        if muon := sorted(name for name in given if name.startswith("optimizer.muon_")):
            raise ConfigError(f"--{muon[0]} sets the Muon optimizer, but --optimizer.name is {o.name}: add "
                              "--optimizer.name Muon, or drop the muon_ settings")
    else:
        if o.muon_lr is not None:
            _number("--optimizer.muon_lr", o.muon_lr, 0)
        _number("--optimizer.muon_momentum", o.muon_momentum, 0, 1, high_open=True)
        if o.muon_weight_decay is not None:
            _number("--optimizer.muon_weight_decay", o.muon_weight_decay, 0)
        _number("--optimizer.muon_ns_steps", o.muon_ns_steps, 1, 99, meaning=" (Newton-Schulz iterations; 5 is usual)")
    _number("--optimizer.lr", o.lr, 0)  # 0 is a use: a step that loads and saves the weights unchanged
    _number("--optimizer.beta1", o.beta1, 0, 1, high_open=True)
    _number("--optimizer.beta2", o.beta2, 0, 1, high_open=True)
    _number("--optimizer.eps", o.eps, 0)
    _number("--optimizer.weight_decay", o.weight_decay, 0)


def _check_lr_scheduler(s: Any) -> None:
    if s.warmup_steps < 0:
        raise ConfigError(f"--lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    if s.total_steps is not None and s.total_steps < 1:
        raise ConfigError(
            f"--lr_scheduler.total_steps must be >= 1 (the steps the schedule spans), got {s.total_steps}; "
            "leave it out to span --training.steps"
        )
    if s.decay_ratio is not None:
        _number("--lr_scheduler.decay_ratio", s.decay_ratio, 0, 1, meaning=" (the fraction of steps that decay)")
    _number("--lr_scheduler.min_lr_factor", s.min_lr_factor, 0, 1, meaning=" (the last lr as a fraction of --optimizer.lr)")


def _check_skipping(t: Any, given: dict[str, int]) -> None:
    """The settings of skipped updates: NaN/Inf gradients and loss spikes (flame.components.spikes)."""
    _number("--training.spike_sigma", t.spike_sigma, 0, meaning=" (standard deviations; 0 = off)")
    spikes = t.spike_sigma > 0
    for name in ("spike_window", "spike_min_steps"):
        if f"training.{name}" in given and not spikes:
            raise ConfigError(
                f"--training.{name} sets the loss-spike policy, which is off: add --training.spike_sigma (e.g. 6), "
                f"or drop --training.{name}"
            )
    if spikes and not 2 <= t.spike_min_steps <= t.spike_window:
        raise ConfigError(
            f"--training.spike_min_steps {t.spike_min_steps} and --training.spike_window {t.spike_window}: a spike is "
            "judged against at least 2 steps and at most the window, so set 2 <= spike_min_steps <= spike_window"
        )
    if "training.max_skipped_steps" in given and not (t.skip_nan_inf or spikes):
        raise ConfigError(
            "--training.max_skipped_steps limits skipped updates, and none are skipped: add --training.skip_nan_inf "
            "or --training.spike_sigma, or drop --training.max_skipped_steps"
        )


def _check_nsys_window(p: Any) -> None:
    """--profiling.nsys_start_step / nsys_stop_step: both or neither, 1 <= start < stop."""
    start, stop = p.nsys_start_step, p.nsys_stop_step
    if start is None and stop is None:
        return
    if start is None or stop is None:
        missing = "nsys_start_step" if start is None else "nsys_stop_step"
        raise ConfigError(f"--profiling.{missing} is missing: an Nsight Systems window needs both ends, e.g. "
                          "--profiling.nsys_start_step 10 --profiling.nsys_stop_step 13 (steps 10-12)")
    if not 1 <= start < stop:
        raise ConfigError(f"--profiling.nsys_start_step {start} and nsys_stop_step {stop}: the window captures steps "
                          "start..stop-1, so give 1 <= start < stop")
def _check_lora(config: Any, given: dict[str, int]) -> None:
    """LoRA's settings, and the layouts its adapters run under (flame.models.lora)."""
    lora = config.lora
    if lora.rank is None:
        if others := sorted(name for name in given if name.startswith("lora.") and name != "lora.rank"):
            raise ConfigError(f"--{others[0]} sets up LoRA, which is off: add --lora.rank (e.g. 16), or drop --{others[0]}")
        return
    if lora.rank <= 0:
        raise ConfigError(f"--lora.rank must be a positive number of adapter dimensions (e.g. 16), got {lora.rank}")
    if not math.isfinite(lora.alpha) or lora.alpha <= 0:
        raise ConfigError(f"--lora.alpha must be a positive number (adapters are scaled by alpha / rank), got {lora.alpha}")
    _number("--lora.dropout", lora.dropout, 0, 1, high_open=True)
    entries = [entry.strip() for entry in lora.targets.split(",")]
    if not all(entries) or ("all-linear" in entries and len(entries) > 1):
        raise ConfigError(
            f"--lora.targets {lora.targets!r}: give module names (q_proj,v_proj), or all-linear alone"
        )
    # PEFT's adapter layers wrap the Linear modules that flame's tensor-parallel plans shard
    if config.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            f"--lora.rank with --parallelism.tensor_parallel_degree {config.parallelism.tensor_parallel_degree}: "
            "LoRA's adapter layers take no tensor-parallel plan; shard with FSDP instead "
            "(--parallelism.data_parallel_shard_degree), which LoRA runs under"
        )

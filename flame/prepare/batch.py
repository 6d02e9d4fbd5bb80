"""A global batch that does not depend on the GPU count: --training.global_batch_size (rows a step) or
--training.global_batch_tokens (tokens a step) fix what one optimizer step sees, and the gradient accumulation is
derived for the data-parallel degree of this run, so that a run moved from 8 GPUs to 4 takes the same steps.

Without either, the global batch is what the per-device settings give (batch_size x data-parallel ranks x
gradient_accumulation_steps), as before.
"""

from typing import Any

from flame.base.errors import ConfigError

ROWS, TOKENS = "training.global_batch_size", "training.global_batch_tokens"


def derive_accumulation(config: Any, given: dict[str, int], dp: int) -> None:
    """Set --training.gradient_accumulation_steps (and, when it was not given, a batch_size that divides the share of
    each rank) from a fixed global batch; ConfigError in one line when the numbers cannot divide."""
    t = config.training
    rows = _global_rows(t, given)
    if rows is None:
        return
    flag = f"--{ROWS} {rows}" if ROWS in given else f"--{TOKENS} {t.global_batch_tokens} ({rows} rows)"
    if rows % dp:
        raise ConfigError(f"{flag} does not divide among {dp} data-parallel ranks: give a global batch that is a multiple "
                          f"of {dp} rows, or run on a number of GPUs that divides {rows}")
    per_rank = rows // dp
    batch_given = "training.local_batch_size" in given or "training.batch_size" in given
    if not batch_given:  # the largest micro-batch up to the default that divides each rank's share
        t.local_batch_size = max(size for size in range(1, min(t.local_batch_size, per_rank) + 1) if per_rank % size == 0)
    if per_rank % t.local_batch_size:
        raise ConfigError(f"{flag} gives each of the {dp} data-parallel ranks {per_rank} rows a step, which "
                          f"--training.batch_size {t.local_batch_size} does not divide: give a batch_size that divides "
                          f"{per_rank} (or leave it out, and flame picks one)")
    accumulation = per_rank // t.local_batch_size
    if "training.gradient_accumulation_steps" in given and t.gradient_accumulation_steps != accumulation:
        raise ConfigError(f"{flag} on {dp} data-parallel ranks with --training.batch_size {t.local_batch_size} takes "
                          f"{accumulation} micro-batch{'es' if accumulation != 1 else ''} a step, and --training.gradient_accumulation_steps says "
                          f"{t.gradient_accumulation_steps}: drop gradient_accumulation_steps (it follows from the "
                          "global batch)")
    t.gradient_accumulation_steps = accumulation


def _global_rows(t: Any, given: dict[str, int]) -> int | None:
    if ROWS in given and TOKENS in given:
        raise ConfigError(f"--{ROWS} and --{TOKENS} both fix the global batch: give one")
    if ROWS in given:
        if t.global_batch_size < 1:
            raise ConfigError(f"--{ROWS} must be >= 1 rows a step, got {t.global_batch_size}")
        return t.global_batch_size
    if TOKENS in given:
        tokens = t.global_batch_tokens
        if tokens is None or tokens < 1 or tokens % t.seq_len:
            rows = max(1, round((tokens or 0) / t.seq_len))
            raise ConfigError(f"--{TOKENS} {tokens} is not a whole number of rows of --training.seq_len {t.seq_len}: "
                              f"give a multiple of {t.seq_len} (e.g. {rows * t.seq_len:,}, {rows} rows)")
        return tokens // t.seq_len
    return None

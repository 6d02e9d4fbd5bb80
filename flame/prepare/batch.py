"""A global batch that does not depend on the GPU count: --training.global_batch_size (rows a step) or
--training.global_batch_tokens (tokens a step) fix what one optimizer step sees, and the gradient accumulation is
derived for the data-parallel degree of this run, so that a run moved from 8 GPUs to 4 takes the same steps.

A batch ramp (--training.batch_ramp) fixes the global batch of each step instead: each rank's micro-batch divides every
step's share, and the accumulation follows the step (flame.training.curriculum); the memory plan plans for the
largest. The curriculum's other settings (context ramp, data phases) are checked here too, against the run's data.

Without any of them, the global batch is what the per-device settings give (batch_size x data-parallel ranks x
gradient_accumulation_steps), as before.
"""

import math
from typing import Any

from flame.base.errors import ConfigError
from flame.config.curriculum import Curriculum
from flame.data.formats import data_format
from flame.data.sources import source_specs

ROWS, TOKENS = "training.global_batch_size", "training.global_batch_tokens"
RAMP, CONTEXT_RAMP = "training.batch_ramp", "training.context_ramp"


def derive_accumulation(config: Any, given: dict[str, int], dp: int) -> None:
    """Set --training.gradient_accumulation_steps (and, when it was not given, a batch_size that divides the share of
    each rank) from a fixed global batch or a batch ramp (the accumulation of its largest batch: what the memory plan
    plans for); ConfigError in one line when the numbers cannot divide, or the curriculum does not fit the run."""
    t = config.training
    curriculum = Curriculum.of(t)
    check_curriculum(config, curriculum)
    batches = _ramp_rows(curriculum, given) or [(None, rows) for rows in filter(None, [_global_rows(t, given)])]
    if not batches:
        return
    fixed = f"--{ROWS} {batches[0][1]}" if ROWS in given else f"--{TOKENS} {t.global_batch_tokens} ({batches[0][1]} rows)"
    flag = lambda step, rows: fixed if step is None else f"--{RAMP}'s {rows} rows from step {step}"  # noqa: E731
    for step, rows in batches:
        if rows % dp:
            raise ConfigError(f"{flag(step, rows)} does not divide among {dp} data-parallel ranks: give a global batch "
                              f"that is a multiple of {dp} rows, or run on a number of GPUs that divides {rows}")
    shares = math.gcd(*(rows // dp for _, rows in batches))  # what every step's share of a rank is a multiple of
    batch_given = "training.local_batch_size" in given or "training.batch_size" in given
    if not batch_given:  # the largest micro-batch up to the default that divides each rank's share
        t.local_batch_size = max(size for size in range(1, min(t.local_batch_size, shares) + 1) if shares % size == 0)
    for step, rows in batches:
        if (rows // dp) % t.local_batch_size:
            raise ConfigError(f"{flag(step, rows)} gives each of the {dp} data-parallel ranks {rows // dp} rows a step, "
                              f"which --training.batch_size {t.local_batch_size} does not divide: give a batch_size that "
                              f"divides {rows // dp} (or leave it out, and flame picks one)")
    accumulation = max(rows for _, rows in batches) // dp // t.local_batch_size
    if "training.gradient_accumulation_steps" in given and t.gradient_accumulation_steps != accumulation:
        raise ConfigError(f"{fixed} on {dp} data-parallel ranks with --training.batch_size {t.local_batch_size} takes "
                          f"{accumulation} micro-batch{'es' if accumulation != 1 else ''} a step, and --training.gradient_accumulation_steps says "
                          f"{t.gradient_accumulation_steps}: drop gradient_accumulation_steps (it follows from the "
                          "global batch)")
    t.gradient_accumulation_steps = accumulation


def check_curriculum(config: Any, curriculum: Curriculum) -> None:
    """The context ramp within --training.context_len and on documents it may cut, one probability per dataset in
    each data phase, lr_follows_batch with a batch ramp."""
    t = config.training
    for step, context in curriculum.context:
        if context > t.context_len:
            raise ConfigError(f"--{CONTEXT_RAMP} gives {context} tokens from step {step}, beyond --training.context_len "
                              f"{t.context_len} (the longest span, which the memory plan plans for): raise context_len "
                              "(and seq_len), or keep the ramp within it")
    specs = source_specs(t)
    whole = [record for record in (data_format(spec.data_format, spec.path) for spec in specs) if record.document_mask]
    if curriculum.context and whole:
        raise ConfigError(f"--{CONTEXT_RAMP} cuts documents shorter early on, and a {whole[0].name} source "
                          f"{whole[0].document_mask}: leave the context ramp out of a run with {whole[0].name} data")
    for phase in curriculum.phases:
        if len(phase.probabilities) != len(specs):
            raise ConfigError(f"--training.data_phases: the phase from step {phase.start} has {len(phase.probabilities)} "
                              f"probabilities for {len(specs)} datasets; give one per dataset (0 leaves one out)")
    if t.lr_follows_batch != "none" and not curriculum.batch:
        raise ConfigError(f"--training.lr_follows_batch {t.lr_follows_batch} scales the lr with a batch ramp, and there "
                          "is none: give --training.batch_ramp, or leave lr_follows_batch at none")


def _ramp_rows(curriculum: Curriculum, given: dict[str, int]) -> list[tuple[int, int]]:
    if not curriculum.batch:
        return []
    for other in (ROWS, TOKENS, "training.gradient_accumulation_steps"):
        if other in given:
            raise ConfigError(f"--{RAMP} and --{other} both set the global batch: the ramp's last entry is the run's "
                              f"global batch, and the accumulation follows; drop --{other}")
    return list(curriculum.batch)


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

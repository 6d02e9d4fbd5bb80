"""Everything decided about a job before a process group exists: every check, and the memory plan.

    prepare(job, world_size)                 each rank, before its Trainer is built (flame.train)
    prepare_settings(job, world_size)        the same short of the model's own checks (tests of settings, data)
    prepare(job, world_size, sources=True)   train.sh's preflight, once, before any rank starts
                                             (flame.launch.preflight): also the dump folder, the
                                             checkpoint the run would load, and every data source

A bad setting, path, model or layout is refused here in one line (``ConfigError``), in seconds,
before GPU time is spent. The model config is read once and its meta model built once
(``ModelUnderCheck``), for every check and the plan. The checks themselves live beside it:
settings (values and combinations), inputs (the files a job names), model (the model against the
tokenizer, the options and the layout), and flame.memory (the plan).
"""

import os
import sys

import datasets
import transformers

from flame import memory
from flame.base import device
from flame.base.errors import ConfigError
from flame.checkpoint.identity import check_same_run
from flame.checkpoint.steps import check_checkpoint, check_checkpoint_fits_model
from flame.config.manager import ParsedJob, parse
from flame.data.records import check_records
from flame.data.shards import DataPlan
from flame.data.tokenizer import load_tokenizer
from flame.data.validation import validation_plan
from flame.distributed.degrees import check_fsdp_options, data_parallel_degree
from flame.prepare import batch, inputs, settings, sizes
from flame.prepare.model import ModelUnderCheck, check_model

__all__ = ["ModelUnderCheck", "prepare", "prepare_settings", "prepared", "settled"]


def prepare(job: ParsedJob, world_size: int, *, sources: bool = False) -> ModelUnderCheck:
    """Check ``job`` for ``world_size`` processes and apply its memory plan (it changes ``job.config`` in place:
    defaults that depend on other settings, the plan's layout, the global batch); the model it checked."""
    if sources:
        # A refusal is one line on stderr: the libraries' own warnings and progress bars stay out of it
        # (the ranks load the same model and data, and show them there).
        transformers.logging.set_verbosity_error()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # it logs an error before raising it
        datasets.disable_progress_bars()
    model = prepare_settings(job, world_size)
    check_model(job.config, model)
    sizes.check_memory(job.config, world_size, model)
    if sources:
        sizes.check_processes(world_size)  # the ranks train.sh is about to start
        _check_sources(job.config, model)
    return model


def prepare_settings(job: ParsedJob, world_size: int) -> ModelUnderCheck:
    """``prepare`` short of the model's own checks: the files found, the settings checked, the memory plan applied.

    What a test of the settings or the data needs from a job; every run goes through ``prepare``.
    """
    config, given = job.config, job.given
    if "metrics.disable_color_printing" not in given and not sys.stdout.isatty():
        # colour codes belong on a terminal; a rank writes to its log files (which train.sh shows on the console)
        config.metrics.disable_color_printing = True
    inputs.resolve_model_files(config, given)
    settings.check(config, given, world_size)
    inputs.check_folders_stay_home(config)
    dp = data_parallel_degree(config, world_size)
    batch.derive_accumulation(config, given, dp)  # a fixed global batch: the accumulation for this many ranks
    device.check_supported(config)
    check_fsdp_options(config, world_size)
    sizes.check_batch(config, world_size)  # before the plan weighs splits of the batch
    model = ModelUnderCheck.load(config.model.config)
    # may split batch_size into micro-batches: the global batch stays
    memory.apply(config, world_size, given, model.config, lambda: model.meta)
    config.training.global_batch_size = config.training.local_batch_size * dp * config.training.gradient_accumulation_steps
    return model


def _check_sources(config, model: ModelUnderCheck) -> None:
    """The dump folder, the checkpoint the run would load, the tokenizer and every data source (train.sh's preflight)."""
    inputs.check_dump_folder(config.job.dump_folder)
    checkpoint = check_checkpoint(config)
    check_checkpoint_fits_model(config, model.meta_copy, checkpoint)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    check_same_run(config, checkpoint, tokenizer)  # the run that saved it: its model, tokenizer, data, optimizer ...
    check_records(DataPlan.from_config(config, tokenizer))  # every record of each source, or a spread sample
    if config.validation.enable:
        check_records(validation_plan(config, tokenizer))  # its datasets exist, have the columns, hold documents


def prepared(args: list[str], world_size: int | None = None):
    """The JobConfig a rank builds its Trainer from: ``args`` parsed and prepared (``world_size``: WORLD_SIZE's)."""
    job = parse(args)
    prepare(job, _world_size(world_size))
    return job.config


def settled(args: list[str], world_size: int | None = None):
    """The JobConfig of ``args`` with its settings prepared (``prepare_settings``): for what builds no model, like the
    loader's benchmark."""
    job = parse(args)
    prepare_settings(job, _world_size(world_size))
    return job.config


def _world_size(given: int | None) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if given is None else given
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE {world_size}: a job runs at least one process")
    return world_size

"""The job's settings, checked: values torch, torchtitan or flame's trainer would refuse only inside the
ranks, after the processes started (or take silently and train wrong): numbers out of range, NaN or Inf,
unknown optimizer names, lists that do not match the datasets, settings that act only together with
another one. ``check`` refuses them in one line each, from ``flame.prepare.prepare``, before any process
group exists; it also resolves the defaults that depend on other settings (context_len, validation's shapes).
"""

import math
import os
from typing import Any

from flame.base.errors import ConfigError
from flame.base.errors import check_number as _number  # shared with the optimizer records' checks
from flame.config.manager import split_list
from flame.data.formats import DATA_FORMATS, choices, data_format as format_record
from flame.optim.groups import parse_rules
from flame.optim.record import OPTIMIZERS, OptimizerRecord, first_that, optimizer_record
from flame.prepare import host_layouts


def check(config: Any, given: dict[str, int], world_size: int) -> None:
    """Refuse what torch, torchtitan or flame's trainer cannot run; ``given``: the dotted names the TOML and CLI set."""
    _check_training(config)
    seed = config.debug.seed
    if seed is not None and not 0 <= seed < 2**32:
        raise ConfigError(f"--debug.seed {seed}: a seed is a number from 0 to 2^32-1 (numpy's and the data order's "
                          "range); give one there, or leave it unset (0)")
    _check_seed_checkpoint(config, world_size)
    _check_eval(config)
    if not config.job.dump_folder.strip():
        raise ConfigError("--job.dump_folder is empty; give the folder for this run's checkpoints and logs (e.g. exp/run)")
    _check_optimizer(config.optimizer, given)
    record = optimizer_record(config.optimizer.name)
    if not record.offloads and config.training.enable_cpu_offload:
        raise ConfigError(
            f"--optimizer.name {record.name} does not combine with --training.enable_cpu_offload: {record.on_gpu_only}, "
            "and offloaded weights and gradients live on the CPU; leave offload off, or use "
            f"{first_that(lambda other: other.offloads).name}"
        )
    host_layouts.check(config, world_size)
    _check_checkpointed_blocks(config)
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
    _check_float8(config)
    _check_validation(config, given)


def _check_checkpointed_blocks(config: Any) -> None:
    """--activation_checkpoint.blocks N: full AC of the first N blocks of the model; --activation_checkpoint.offload:
    their inputs on the host."""
    ac = config.activation_checkpoint
    if ac.offload and ac.mode != "full":
        raise ConfigError(f"--activation_checkpoint.offload moves the inputs full AC keeps to the host, and "
                          f"--activation_checkpoint.mode is {ac.mode}: add --activation_checkpoint.mode full")
    if ac.offload and config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("--activation_checkpoint.offload follows the model's blocks from the forward to the backward, "
                          "which pipeline schedules interleave: leave it off under pipeline parallelism")
    if ac.blocks is None:
        return
    if ac.mode != "full":
        raise ConfigError(f"--activation_checkpoint.blocks {ac.blocks} chooses how many blocks full AC checkpoints, and "
                          f"--activation_checkpoint.mode is {ac.mode}: add --activation_checkpoint.mode full")
    if ac.blocks < 1:
        raise ConfigError(f"--activation_checkpoint.blocks must be at least 1, got {ac.blocks}; for no AC use "
                          "--activation_checkpoint.mode none")
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("--activation_checkpoint.blocks counts the whole model's blocks, which pipeline stages split: "
                          "use --activation_checkpoint.mode selective with an every-N option under pipeline parallelism")


def _check_optimizer(o: Any, given: dict[str, int]) -> None:
    """The optimizer's record (flame.optim.record): a known name, no settings of another optimizer, its own in range."""
    record = optimizer_record(o.name)
    for other in OPTIMIZERS.values():
        if other is not record and (owned := sorted(name for name in other.owns if name in given)):
            raise ConfigError(f"--{owned[0]} sets the {other.name} optimizer, but --optimizer.name is {o.name}: add "
                              f"--optimizer.name {other.name}, or drop {_own_settings(other)}")
    record.check(o)
    _number("--optimizer.lr", o.lr, 0)  # 0 is a use: a step that loads and saves the weights unchanged
    _number("--optimizer.beta1", o.beta1, 0, 1, high_open=True)
    _number("--optimizer.beta2", o.beta2, 0, 1, high_open=True)
    _number("--optimizer.eps", o.eps, 0)
    _number("--optimizer.weight_decay", o.weight_decay, 0)
    parse_rules(o.param_groups)  # its syntax; what it selects is checked against the model (flame.prepare.model)


def _own_settings(record: OptimizerRecord) -> str:
    """How a refusal names an optimizer's own settings: by their common prefix (the muon_ settings), or the one flag."""
    names = [name.partition(".")[2] for name in record.owns]
    prefix = os.path.commonprefix(names)
    return f"the {prefix} settings" if len(names) > 1 and prefix else f"--{record.owns[0]}"


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
    """The settings of skipped updates: NaN/Inf gradients and loss spikes (flame.training.spikes)."""
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


def _check_float8(config: Any) -> None:
    """FP8's layouts (flame.models.float8); the GPU's FP8 tensor cores are checked where the model is converted."""
    tp = config.parallelism.tensor_parallel_degree
    if config.float8.recipe_name != "off" and tp > 1:
        raise ConfigError(f"--float8.recipe_name with --parallelism.tensor_parallel_degree {tp}: flame's tensor-parallel "
                          "plans shard nn.Linear layers, not FP8's; shard with FSDP (data_parallel_shard_degree) instead, "
                          "or leave --float8.recipe_name off")


def _check_validation(config: Any, given: dict[str, int]) -> None:
    """The validation set's settings (flame.training.validation); resolves its defaults from training's."""
    v, t = config.validation, config.training
    if not v.enable:
        if others := sorted(name for name in given if name.startswith("validation.") and name != "validation.enable"):
            raise ConfigError(f"--{others[0]} sets up validation, which is off: add --validation.enable, or drop --{others[0]}")
        return
    if v.holdout_documents < 0:
        raise ConfigError(f"--validation.holdout_documents must be >= 0 (documents per training source), got {v.holdout_documents}")
    if bool(v.dataset.strip()) == bool(v.holdout_documents):
        both = "both --validation.dataset and" if v.holdout_documents else "neither --validation.dataset nor"
        raise ConfigError(
            f"--validation.enable with {both} --validation.holdout_documents: give one, a validation dataset or the "
            "number of documents to hold out of each training source"
        )
    if v.holdout_documents and t.streaming:
        raise ConfigError(
            "--validation.holdout_documents holds out the first documents of map-style sources, and --training.streaming "
            "streams them: give a separate --validation.dataset, or drop --training.streaming"
        )
    if v.freq < 1:
        raise ConfigError(f"--validation.freq must be >= 1 (steps between evaluations), got {v.freq}")
    if v.steps < 1 and v.steps != -1:
        raise ConfigError(f"--validation.steps must be >= 1 (batches per source) or -1 (all), got {v.steps}")
    v.local_batch_size = t.local_batch_size if v.local_batch_size is None else v.local_batch_size
    v.seq_len = t.seq_len if v.seq_len is None else v.seq_len
    for name in ("local_batch_size", "seq_len"):
        if getattr(v, name) < 1:
            raise ConfigError(f"--validation.{name} must be >= 1, got {getattr(v, name)}")
    p = config.parallelism
    if p.pipeline_parallel_degree > 1 and (v.local_batch_size, v.seq_len) != (t.local_batch_size, t.seq_len):
        raise ConfigError(
            "--validation.local_batch_size and seq_len: pipeline stages take the shapes of training's batches; "
            "leave them at training's (unset) under --parallelism.pipeline_parallel_degree"
        )
    datasets = split_list(v.dataset, paths=True) if v.dataset.strip() else []
    for name in ("dataset_name", "dataset_split", "data_dir", "data_files", "data_format"):
        value = getattr(v, name)
        entries = value.split(",") if value is not None and f"validation.{name}" in given else []
        if entries and (not datasets or len(entries) not in (1, len(datasets))):
            raise ConfigError(
                f"--validation.{name} has {len(entries)} entries for {len(datasets)} validation datasets: give one "
                "entry per dataset (empty entries allowed) or a single one for all"
            )
    check_data_formats("--validation", v.data_format, t.document_mask, datasets=datasets)


def _check_training(config: Any) -> None:
    t = config.training
    _number("--training.ema_decay", t.ema_decay, 0, 1, high_open=True, meaning=" (0.999 is usual; 0 = off)")
    _number("--training.z_loss", t.z_loss, 0, meaning=" (its coefficient; 1e-4 is usual, 0 = off)")
    _number("--training.logit_softcap", t.logit_softcap, 0, meaning=" (the cap c of c x tanh(logit / c); 0 = off)")
    if not t.dataset:
        raise ConfigError("no dataset given: set --training.dataset (e.g. builtin:python-stdlib or a path)")
    if t.seq_len <= 0:
        raise ConfigError(f"--training.seq_len must be positive, got {t.seq_len}")
    if t.context_len is None:
        t.context_len = t.seq_len
    if t.context_len <= 0 or t.context_len > t.seq_len:
        raise ConfigError(
            f"--training.context_len {t.context_len} must be between 1 and --training.seq_len {t.seq_len}"
        )
    if t.local_batch_size <= 0:
        raise ConfigError(f"--training.batch_size must be positive, got {t.local_batch_size}")
    if t.varlen and t.local_batch_size != 1:
        raise ConfigError(
            f"--training.varlen packs one row per device but --training.batch_size is {t.local_batch_size}: "
            "set --training.batch_size 1 and raise --training.seq_len instead"
        )
    if t.gradient_accumulation_steps < 1:
        raise ConfigError(
            f"--training.gradient_accumulation_steps must be >= 1, got {t.gradient_accumulation_steps}"
        )
    if t.steps < 1 and not config.checkpoint.create_seed_checkpoint:
        raise ConfigError(
            f"--training.steps must be >= 1 (optimizer steps to train), got {t.steps}; to write initial weights "
            "without training, use --checkpoint.create_seed_checkpoint"
        )
    if t.max_norm <= 0:
        raise ConfigError(f"--training.max_norm must be positive, got {t.max_norm}")
    for name in ("num_workers", "shuffle_buffer", "row_shuffle_buffer", "data_shards", "max_skipped_steps"):
        value = t.dataloader.num_workers if name == "num_workers" else getattr(t, name)
        if value < 0:
            raise ConfigError(f"--training.{name} must be >= 0, got {value}")
    datasets = split_list(t.dataset, paths=True)
    for name in ("dataset_name", "dataset_split", "data_dir", "data_files", "data_format"):
        entries = split_list(getattr(t, name))
        if entries and len(entries) not in (1, len(datasets)):
            raise ConfigError(
                f"--training.{name} has {len(entries)} entries for {len(datasets)} datasets: "
                "give one entry per dataset (empty entries allowed) or a single one for all"
            )
    check_data_formats("--training", t.data_format, t.document_mask, t, datasets)
    if t.data_probs is not None:
        probs = split_list(t.data_probs)
        if len(probs) != len(datasets):
            raise ConfigError(
                f"--training.data_probs has {len(probs)} entries for {len(datasets)} datasets; give one per dataset"
            )
        try:
            values = [float(p) for p in probs]
        except ValueError:
            raise ConfigError(f"--training.data_probs must be numbers, got {t.data_probs!r}") from None
        # NaN compares false: caught here too. A 0 leaves a source out until a data phase brings it in.
        if not all(math.isfinite(v) and v >= 0 for v in values) or not sum(values) > 0:
            raise ConfigError(f"--training.data_probs must all be finite numbers >= 0 with a positive sum (weights, "
                              f"normalized to sum to 1; 0 leaves a source out), got {t.data_probs!r}")
    if config.checkpoint.keep_latest_k == 1:
        raise ConfigError(
            "--checkpoint.keep_latest_k 1 could delete the only loadable checkpoint during a save: use 0 (keep all) or >= 2"
        )
    if config.checkpoint.keep_latest_k < 0:
        raise ConfigError(
            f"--checkpoint.keep_latest_k {config.checkpoint.keep_latest_k}: use 0 (keep every checkpoint) or >= 2 "
            "(keep that many of the newest)"
        )
    if config.checkpoint.interval <= 0:
        raise ConfigError(f"--checkpoint.interval must be positive, got {config.checkpoint.interval}")
    if config.metrics.log_freq <= 0:
        raise ConfigError(f"--metrics.log_freq must be positive, got {config.metrics.log_freq}")


def check_data_formats(section: str, data_format: str | None, document_mask: bool, training: Any = None,
                       datasets: list[str] = ()) -> None:
    """``<section>.data_format``: a known format per dataset (flame.data.formats), its documents kept apart where
    its record needs them apart.

    ``training``: the job's training config, whose format-only fields (a record's ``options``) set away from
    their defaults need a source of a format that reads them. ``datasets``: the section's dataset paths, whose
    files may tell their format (a record's ``detect``).
    """
    entries = split_list(data_format) or [None]
    if unknown := sorted({entry for entry in entries if entry and entry not in DATA_FORMATS}):
        raise ConfigError(f"{section}.data_format {data_format}: {', '.join(unknown)} is not a format; "
                          f"give {choices()} per dataset")
    entries = entries * len(datasets) if len(entries) == 1 and datasets else entries
    paths = [*datasets, *[None] * (len(entries) - len(datasets))]
    given = {format_record(entry, path).name for entry, path in zip(entries, paths)}
    formats = [record for record in DATA_FORMATS.values() if record.name in given]  # in the registry's order
    for record in formats:
        if record.document_mask and not document_mask:
            raise ConfigError(f"{section}.data_format {record.name} {record.document_mask}: "
                              "drop --training.no-document_mask")
    read = {option.name for record in formats for option in record.options}
    for record in DATA_FORMATS.values():
        for option in record.options:
            value = getattr(training, option.name, option.default)
            if option.name not in read and value != option.default:
                raise ConfigError(f"{option.flag(value)} applies to {record.label} sources, and no dataset is one: set "
                                  f"--training.data_format {record.name} for the {record.kind} datasets, or drop the flag")


def _check_seed_checkpoint(config: Any, world_size: int) -> None:
    if not config.checkpoint.create_seed_checkpoint:
        return
    if world_size != 1:
        raise ConfigError(
            f"--checkpoint.create_seed_checkpoint writes unsharded initial weights from one process, but this job has "
            f"{world_size}: run it with NGPU=1 (one node), then start any layout from it"
        )
    if not config.checkpoint.enable:
        raise ConfigError("--checkpoint.create_seed_checkpoint saves a checkpoint: drop --checkpoint.no-enable")


def _check_eval(config: Any) -> None:
    """Refuse --eval settings that cannot work (flame.training.evaluation scores the saved checkpoints)."""
    e, c = config.eval, config.checkpoint
    if not e.tasks.strip():
        if e.interval or e.include_path or e.limit is not None or e.num_fewshot is not None:
            raise ConfigError("--eval.interval/include_path/limit/num_fewshot apply to --eval.tasks, which is empty: "
                              "name the tasks (e.g. --eval.tasks piqa,hellaswag) or drop them")
        return
    if not c.enable or c.load_only:
        raise ConfigError("--eval.tasks scores saved checkpoints, and this run saves none: add --checkpoint.enable "
                          "(without --checkpoint.load_only), or drop --eval.tasks")
    if e.interval < 0 or (e.interval and e.interval % c.interval):
        raise ConfigError(f"--eval.interval {e.interval} must be a positive multiple of --checkpoint.interval "
                          f"{c.interval} (evaluations score saved checkpoints), or 0 for every checkpoint")
    if e.include_path and not os.path.isdir(e.include_path):
        raise ConfigError(f"--eval.include_path {e.include_path} is not a directory; give the folder of your task "
                          "YAML files (configs/eval/ holds an example)")
    if e.batch_size < 1 or (e.limit is not None and e.limit <= 0) or (e.num_fewshot is not None and e.num_fewshot < 0):
        raise ConfigError("--eval.batch_size must be >= 1, --eval.limit > 0 and --eval.num_fewshot >= 0")

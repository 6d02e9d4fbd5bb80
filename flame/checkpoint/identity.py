"""A run's identity: what makes a resume the same run. Recorded with every checkpoint step, compared at preflight.

    identity(job_config, tokenizer)              what defines the run, as JSON (each field a dict of settings)
    check_same_run(job_config, path, tokenizer)  train.sh's preflight, before it resumes ``path``

The fields (``FIELDS``): the model config, the tokenizer (a fingerprint of its vocabulary, merges,
normalization and special tokens), the data (sources, mixture, formats, packing, shuffling), the seed,
seq_len, context_len, the global batch, the optimizer and its settings, the lr and the LR schedule.
The trainer's checkpoint manager (flame.checkpoint.manager) writes the identity into each step's
manifest; a resume whose identity differs from the step's is refused in one line naming each
field, unless ``--checkpoint.accept_changes`` names it: then preflight prints what changes, and the
run applies it from the resumed step on (the model, tokenizer and data as configured; the optimizer's
settings, base lrs and schedule through flame.optim.builder.ConfiguredSettings).

``--training.steps`` is no field: raising it is how a run continues. The schedule spans the new
total (torchtitan's schedule is a function of it, unless ``--lr_scheduler.total_steps`` fixes it);
when that moves the lr of a step still to come, preflight prints one note saying so.
"""

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flame.base.errors import ConfigError
from flame.checkpoint import manifest
from flame.checkpoint.steps import model_only
from flame.data.tokenizer import load_tokenizer
from flame.models.model_config import load_model_config
from flame.optim.builder import schedule
from flame.optim.record import optimizer_record

_DATA = ("dataset", "dataset_name", "dataset_split", "data_dir", "data_files", "data_probs", "mix_unit", "data_format",
         "streaming", "text_column", "sft_loss_on", "truncate_long", "token_dtype", "delimiters", "separator_token",
         "document_mask", "varlen", "shuffle_buffer", "row_shuffle_buffer", "source_exhausted")
_SCHEDULE = ("warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor")
# bookkeeping of transformers and tokenizers, not of the model or the tokenizer: a new version rewrites them
_MODEL_BOOKKEEPING = ("transformers_version", "_name_or_path")
_TOKENIZER_BOOKKEEPING = ("version", "truncation", "padding")
_STEP = re.compile(r"step-(\d+)")
_SAMPLES = 10_000  # steps of two schedules compared at most


def _flat(value: dict, prefix: str = "") -> dict:
    """Nested dicts as one, under dotted keys (rope_parameters.rope_theta)."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict) and item:
            flat |= _flat(item, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = item
    return flat


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex digits) of what turns text into ids: the backend's vocabulary, merges, normalizer, pre- and
    post-processing and added tokens, the special tokens the data pipeline puts around documents, the chat template."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    specials = {name: [getattr(tokenizer, name), getattr(tokenizer, f"{name}_id")]
                for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    described = {"backend": {k: v for k, v in backend.items() if k not in _TOKENIZER_BOOKKEEPING}, "specials": specials,
                 "chat_template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _as_on_disk(job_config, tokenizer):
    """The run's tokenizer as its files define it: loaded afresh, not the process's shared (cached) object, which a
    caller may have changed since (a chat template set on it, say)."""
    path = job_config.model.tokenizer_path
    return load_tokenizer.__wrapped__(path) if path else tokenizer


def _model(job_config, tokenizer) -> dict:
    config = load_model_config(job_config.model.config).to_dict()
    return _flat({k: v for k, v in config.items() if k not in _MODEL_BOOKKEEPING})


def _set(training, *names: str) -> dict:
    """The curriculum's settings a run gives (flame.config.curriculum), by dotted name: a run without them has the
    identity of a run saved before they existed."""
    unset = {"batch_ramp": "", "context_ramp": "", "data_phases": "", "lr_follows_batch": "none"}
    return {f"training.{name}": getattr(training, name) for name in names if getattr(training, name) != unset[name]}


def _data(job_config, tokenizer) -> dict:
    training, validation = job_config.training, job_config.validation
    data = {f"training.{name}": getattr(training, name) for name in _DATA} | _set(training, "data_phases")
    data["validation.holdout_documents"] = validation.holdout_documents if validation.enable else 0  # never trained on
    return data


def _owned(job_config) -> dict:
    """The settings only this run's optimizer reads (its record's ``owns``: Muon's muon_* fields), by dotted name."""
    fields = optimizer_record(job_config.optimizer.name).owns
    return {name: getattr(job_config.optimizer, name.split(".", 1)[1]) for name in fields}


def _optimizer(job_config, tokenizer) -> dict:
    o = job_config.optimizer
    shared = {f"optimizer.{name}": getattr(o, name)
              for name in ("name", "beta1", "beta2", "eps", "weight_decay", "decay_everything", "param_groups")}
    return shared | {name: value for name, value in _owned(job_config).items() if not name.endswith("_lr")}


def _lr(job_config, tokenizer) -> dict:
    return {"optimizer.lr": job_config.optimizer.lr} | {
        name: value for name, value in _owned(job_config).items() if name.endswith("_lr")}


@dataclass(frozen=True)
class Field:
    """One part of a run's identity: its settings as a dict, and how the refusal names a setting (``shown``)."""

    name: str
    value: Callable[[Any, Any], dict]  # (job_config, tokenizer) -> {setting: value}
    shown: Callable[[str], str] = lambda key: f"--{key}"
    # whether a setting only one side has differs: not for the model config, where a key one side lacks is a default
    # another transformers version added or dropped (a value the user gives is there on both sides, as a default)
    one_sided: bool = True


FIELDS = [
    Field("model", _model, lambda key: f"--model.config's {key}", one_sided=False),
    Field("tokenizer", lambda c, t: {"fingerprint": tokenizer_fingerprint(_as_on_disk(c, t))},
          lambda key: "--model.tokenizer_path's vocabulary, merges or special tokens, fingerprint"),
    Field("data", _data),
    Field("seed", lambda c, t: {"debug.seed": c.debug.seed}),
    Field("seq_len", lambda c, t: {"training.seq_len": c.training.seq_len}),
    Field("context_len", lambda c, t: {"training.context_len": c.training.context_len,
                                       **_set(c.training, "context_ramp")}),
    Field("batch", lambda c, t: {"rows": c.training.global_batch_size, **_set(c.training, "batch_ramp", "lr_follows_batch")},
          lambda key: "rows a step: --training.batch_size x data-parallel ranks x --training.gradient_accumulation_steps"
          if key == "rows" else f"--{key}"),
    Field("optimizer", _optimizer),
    Field("lr", _lr),
    Field("schedule", lambda c, t: {f"lr_scheduler.{name}": getattr(c.lr_scheduler, name) for name in _SCHEDULE}),
]
NAMES = [field.name for field in FIELDS]


def identity(job_config, tokenizer) -> dict:
    """What defines the run of a prepared ``job_config`` (flame.prepare), as JSON: field -> {setting: value}, and
    recorded but not compared: ``steps`` (for the schedule's note) and, when the step holds an average of the
    weights, ``ema_decay`` (a resume may turn it on or off: flame.checkpoint.manager)."""
    fields = {field.name: field.value(job_config, tokenizer) for field in FIELDS}
    ema = {"ema_decay": job_config.training.ema_decay} if job_config.training.ema_decay else {}
    return json.loads(json.dumps({**fields, "steps": job_config.training.steps, **ema}, default=str))


def _shown(value: Any) -> str:
    text = "unset" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def differences(saved: dict, current: dict) -> dict[str, str]:
    """field -> what differs (``--optimizer.lr 0.003 -> 0.001``), for the fields ``saved`` holds (a field an earlier
    flame did not record is not compared)."""
    found = {}
    for field in FIELDS:
        if not isinstance(old := saved.get(field.name), dict):
            continue
        new = current[field.name]
        keys = [*new, *(key for key in old if key not in new)]  # in the field's order: --optimizer.name first
        if not field.one_sided:
            keys = [key for key in keys if key in old and key in new]
        changed = [f"{field.shown(key)} {_shown(old.get(key))} -> {_shown(new.get(key))}"
                   for key in keys if old.get(key) != new.get(key)]
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            found[field.name] = ", ".join(changed[:3]) + more
    return found


def accepted(job_config) -> set[str]:
    """The fields ``--checkpoint.accept_changes`` names; ConfigError for a name that is not one."""
    names = {name.strip() for name in job_config.checkpoint.accept_changes.split(",") if name.strip()}
    if unknown := sorted(names - set(NAMES)):
        raise ConfigError(f"--checkpoint.accept_changes {unknown[0]}: not a field of a run's identity; "
                          f"name some of {', '.join(NAMES)}")
    return names


def _state_that_cannot_follow(job_config, saved: dict, current: dict, allowed: set[str]) -> None:
    """ConfigError for an accepted change that the saved state of the optimizer or the data loader cannot follow."""
    excluded = job_config.checkpoint.exclude_from_loading or []
    for field, setting, state in (("optimizer", "optimizer.name", "optimizer"), ("data", "training.dataset", "dataloader")):
        old, new = saved.get(field, {}).get(setting), current[field][setting]
        if field in allowed and old is not None and old != new and state not in excluded:
            raise ConfigError(
                f"--checkpoint.accept_changes {field}: the checkpoint's {state} state belongs to --{setting} {old}, "
                f"which --{setting} {new} cannot continue; add --checkpoint.exclude_from_loading {state} to start "
                f"its state afresh"
            )


def _schedule_note(job_config, saved: dict, current: dict, step: int) -> str | None:
    """One line when this run's schedule moves the lr of a step still to come from the saved run's, else None."""
    old_steps, new_steps = saved.get("steps"), current["steps"]
    if not isinstance(old_steps, int) or old_steps == new_steps or not isinstance(saved.get("schedule"), dict):
        return None
    old_schedule = {key.removeprefix("lr_scheduler."): value for key, value in saved["schedule"].items()}
    before = schedule(replace(job_config.lr_scheduler, **old_schedule), old_steps)
    after = schedule(job_config.lr_scheduler, new_steps)
    stride = max(1, (new_steps - step) // _SAMPLES)
    moved = next((n for n in range(step, new_steps, stride) if before(n) != after(n)), None)
    if moved is None:
        return None
    return (f"--training.steps {new_steps} (the saved run's: {old_steps}): the LR schedule is recomputed for the new "
            f"total, so step {moved + 1} trains at {after(moved):.3g} x --optimizer.lr, where the saved run's schedule "
            f"had {before(moved):.3g} x")


def check_same_run(job_config, path: str | None, tokenizer) -> None:
    """Refuse (ConfigError, one line) resuming ``path``, the checkpoint check_checkpoint chose, as a run whose identity
    differs from the one that saved it, unless --checkpoint.accept_changes names every field that differs; print
    what an accepted change, a checkpoint without an identity, or a new --training.steps changes."""
    allowed = accepted(job_config)
    if path is None or model_only(job_config, path):
        return  # nothing loads, or the weights alone: a new run starts
    saved = manifest.read_identity(path)
    if saved is None:
        print(f"flame: note: {path} records no run identity (saved by an earlier flame, or its manifest recorded by "
              "hand), so this resume is not compared with the run that saved it")
        return
    current = identity(job_config, tokenizer)
    found = differences(saved, current)
    if refused := [name for name in found if name not in allowed]:
        listed = "; ".join(f"{name} ({found[name]})" for name in refused)
        raise ConfigError(
            f"this run would resume {path}, which another run saved: {listed}; give that run's settings, or add "
            f"--checkpoint.accept_changes {','.join(sorted(allowed | set(refused), key=NAMES.index))} to change "
            "them from here on, or give this run its own --job.dump_folder"
        )
    _state_that_cannot_follow(job_config, saved, current, allowed)
    match = _STEP.fullmatch(os.path.basename(os.path.normpath(path)))
    step = int(match.group(1)) if match else None
    if found:
        listed = "; ".join(f"{name} ({text})" for name, text in found.items())
        print(f"flame: resuming {path} with the changes --checkpoint.accept_changes accepts: {listed}; they apply "
              f"from step {step + 1 if step is not None else 'the resumed one'} on")
    if step is not None and (note := _schedule_note(job_config, saved, current, step)):
        print(f"flame: note: {note}")

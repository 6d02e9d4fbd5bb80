"""The model card (README.md) of an HF export, derived from the run's dump folder.

Its metadata (huggingface_hub's ``ModelCardData``) is what the hub indexes: the library, the
pipeline, tags (flame, the model type, fla), the base model (``--model.init_from`` when it names
a hub model), the hub datasets trained on, a license (the base model's, when its card has one)
and the lm-eval scores of the exported step (<dump>/eval/step-N/) as model-index results. Its
body says what the model is (architecture, parameters), how it was trained (tokens, data and
their mix, the command line, flame's version), and how well (the training loss and, when logged,
validation loss and bits per byte at the exported step; the lm-eval scores). Everything comes
from the dump folder's job_config.json, metrics.jsonl, eval/ and attempts/: nothing is written there.

A card is published with the model (flame.tools.push), so it names no place on this machine:
a path into the dump folder shows relative to it, any other local path by its base name.
"""

import functools
import glob
import json
import os
import re
import shlex
import subprocess
from importlib import metadata

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData, metadata_load, try_to_load_from_cache
from transformers import PretrainedConfig

from flame.base import run_record
from flame.data import builtin
from flame.models.registry import fla_model_types

# (row label, config attributes tried in order): the architectures name these differently
_SHAPE = (
    ("layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("hidden size", ("hidden_size", "n_embd", "d_model")),
    ("attention heads", ("num_attention_heads", "num_heads", "n_head")),
    ("key/value heads", ("num_key_value_heads", "num_kv_heads")),
    ("vocabulary", ("vocab_size",)),
    ("max_position_embeddings", ("max_position_embeddings", "n_positions")),
)
LOAD_FLAME = "import flame; flame.register()  # fla's and custom_models' types; flash-attn is not needed"
LM_EVAL = ("lm-evaluation-harness", "https://github.com/EleutherAI/lm-evaluation-harness")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# data files and datasets' packaged builders (which read local data_files) are not hub names
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt", ".arrow", ".csv", ".gz", ".zst")
_PACKAGED = {"json", "parquet", "text", "csv", "arrow", "webdataset", "imagefolder", "audiofolder"}
_LICENSE_KEYS = ("license", "license_name", "license_link")


@functools.cache
def flame_version() -> str:
    """flame's version, with the git commit of its source tree where there is one."""
    try:
        version = metadata.version("flame")
    except metadata.PackageNotFoundError:
        version = "unknown"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version} (git {commit})" if commit else version


def hub_id(location: str | None, kind: str = "models") -> str | None:
    """The hub repo id ``location`` names: itself when a hub name, the repo of an HF cache folder
    (``.../models--org--name/snapshots/...``), else None (a local path, ``builtin:``, a packaged builder)."""
    location = (location or "").strip()
    cached = re.search(rf"(?:^|/){kind}--([^/]+)", location)
    if cached:
        return cached[1].replace("--", "/")
    if (not _HUB_NAME.fullmatch(location) or location in _PACKAGED or location.endswith(_FILE_SUFFIXES)
            or os.path.exists(location)):
        return None
    return location


def portable(value: str, dump_folder: str) -> str:
    """``value`` as a published card may show it: each comma-separated path on this machine (absolute,
    under ~, or climbing out with ..) as the hub repo of an HF cache folder, relative to the dump folder
    when inside it, else by its base name."""
    dump = os.path.abspath(dump_folder)
    parts = []
    for part in value.split(","):
        if part.startswith(("/", "~")) or ".." in part.split("/"):
            path = os.path.abspath(os.path.expanduser(part))
            inside = path.startswith(dump + os.sep)
            part = (hub_id(path) or hub_id(path, "datasets") or (os.path.relpath(path, dump) if inside else None)
                    or os.path.basename(path) or part)
        parts.append(part)
    return ",".join(parts)


def _portable_command(command: str, dump_folder: str) -> str:
    try:
        tokens = shlex.split(command)
    except ValueError:  # unbalanced quotes: words as they are
        tokens = command.split()
    shown = []
    for token in tokens:
        flag, equals, value = token.partition("=") if token.startswith("--") else ("", "", token)
        shown.append(shlex.quote(flag + equals + portable(value, dump_folder)) if not flag or equals else token)
    return " ".join(shown)


def _source_label(source: str, dump_folder: str) -> str:
    if builtin.is_builtin(source) or hub_id(source, "datasets"):
        return f"source `{source}`"
    kind = "files" if glob.has_magic(source) else "folder" if os.path.isdir(os.path.expanduser(source)) else "file"
    return f"local {kind} `{os.path.basename(os.path.normpath(portable(source, dump_folder)))}`"


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return lines + [f"| {name} | {value} |" for name, value in rows]


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _sources(training: dict) -> list[str]:
    return [s.strip() for s in str(training["dataset"]).split(",")] if training.get("dataset") else []


def _data_rows(training: dict, records: dict, step: int, dump_folder: str) -> list[tuple[str, str]]:
    sources = _sources(training)

    def per_source(key: str) -> list[str]:
        values = str(training.get(key) or "").split(",")
        return [values[i].strip() if i < len(values) else "" for i in range(len(sources))]

    names, splits, files, probs = (per_source(k) for k in ("dataset_name", "dataset_split", "data_files", "data_probs"))
    rows = []
    for source, name, split, data_files, prob in zip(sources, names, splits, files, probs):
        details = [f"config {name}" if name else "", f"split {split or 'train'}",
                   f"files {portable(data_files, dump_folder)}" if data_files else "",
                   f"probability {prob} of {training.get('mix_unit', 'documents')}" if prob else ""]
        rows.append((_source_label(source, dump_folder), ", ".join(d for d in details if d)))
    row = records.get(max((s for s in records if s <= step), default=step), {})
    # a local source's counters are named by its path
    tokens = {portable(key[5:-7], dump_folder): value for key, value in row.items()
              if key.startswith("data/") and key.endswith("/tokens")}
    total = sum(tokens.values())
    if total:
        rows.append(("tokens per source", ", ".join(f"{name} {value:,} ({100 * value / total:.1f}%)"
                                                    for name, value in tokens.items())))
    return rows


def _base_license(init_from: str | None) -> dict[str, str]:
    """The license fields of the base model's card: its folder's README.md, or a hub model's in the local HF cache."""
    if not init_from:
        return {}
    readme = os.path.join(init_from, "README.md")
    if not os.path.isfile(readme) and (repo := hub_id(init_from)):
        cached = try_to_load_from_cache(repo, "README.md")  # offline: the cache only
        readme = cached if isinstance(cached, str) else ""
    found = {}
    if os.path.isfile(readme):
        try:
            found = metadata_load(readme) or {}
        except (OSError, ValueError):  # a card without readable metadata names no license
            pass
    return {key: str(found[key]) for key in _LICENSE_KEYS if found.get(key)}


def _task_datasets(dump_folder: str, step: int) -> dict[str, dict]:
    """task -> its lm-eval config (dataset_path, dataset_name, splits), from the results files of ``step``."""
    configs: dict[str, dict] = {}
    pattern = os.path.join(glob.escape(dump_folder), "eval", f"step-{step}", "**", "*.json")
    for path in sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime):
        try:
            with open(path) as f:
                found = json.load(f).get("configs")
        except (OSError, ValueError, AttributeError):
            continue
        configs.update({task: c for task, c in (found or {}).items() if isinstance(c, dict)})
    return configs


def _eval_results(scores: dict[str, float], configs: dict[str, dict]) -> list[EvalResult]:
    results = []
    for key, value in scores.items():
        task, _, metric = key.rpartition("/")
        config = configs.get(task, {})
        split = config.get("test_split") or config.get("validation_split")
        results.append(EvalResult(
            task_type="text-generation", dataset_type=hub_id(config.get("dataset_path"), "datasets") or task,
            dataset_name=task, dataset_config=config.get("dataset_name") if isinstance(config.get("dataset_name"), str) else None,
            dataset_split=split if isinstance(split, str) else None, metric_type=metric, metric_value=value,
            source_name=LM_EVAL[0], source_url=LM_EVAL[1]))
    return results


def card_data(dump_folder: str, step: int, model: torch.nn.Module, config: PretrainedConfig, run: dict,
              exported_as: str | None = None) -> ModelCardData:
    """The card's metadata: what the hub indexes the exported ``model`` by."""
    init_from = run.get("model", {}).get("init_from")
    datasets = [found for source in _sources(run.get("training", {})) if (found := hub_id(source, "datasets"))]
    tags = ["flame", config.model_type] + ([exported_as] if exported_as else [])
    if config.model_type in fla_model_types() and not exported_as:
        tags.append("fla")
    try:
        records = run_record.metrics(dump_folder)
    except ValueError:
        records = {}
    results = _eval_results(run_record.eval_scores(dump_folder, records).get(step, {}), _task_datasets(dump_folder, step))
    return ModelCardData(
        library_name="peft" if hasattr(model, "peft_config") else "transformers", pipeline_tag="text-generation",
        tags=tags, base_model=hub_id(init_from) if init_from else None, datasets=list(dict.fromkeys(datasets)) or None,
        model_name=_name(dump_folder) if results else None, eval_results=results or None, **_base_license(init_from),
    )


def _name(dump_folder: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(dump_folder)))


def _base_line(init_from: str | None, dump_folder: str) -> list[str]:
    if not init_from:
        return []
    if repo := hub_id(init_from):
        return [f"Fine-tuned from [`{repo}`](https://huggingface.co/{repo}).", ""]
    return [f"Fine-tuned from a local model (`{os.path.basename(os.path.normpath(portable(init_from, dump_folder)))}`).", ""]


def render(
    dump_folder: str, step: int, model: torch.nn.Module, config: PretrainedConfig, run: dict,
    exported_as: str | None = None, dtype: str = "float32", export_choice: str | None = None,
) -> str:
    """The card's markdown for ``model`` (the exported weights, of ``config``) at ``step`` of the run in ``dump_folder``.

    ``run`` is the run's job config (job_config.json, {} if none); ``exported_as`` the
    architecture the weights were written under when not the model's own (``llama``); ``export_choice`` why
    (flame.checkpoint.llama_export.choose).
    """
    try:
        records = run_record.metrics(dump_folder)
    except ValueError:  # no metrics.jsonl (a run that logged nothing): the card says what it can
        records = {}
    training = run.get("training", {})
    architecture = config.model_type + (f", exported as `{exported_as}`" if exported_as else "")
    params = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel() if model.get_input_embeddings() is not None else 0
    standard = exported_as is not None or config.model_type in ("llama", "mistral", "qwen2", "qwen3", "gpt2")

    lines = [f"# {_name(dump_folder)}", "",
             f"A causal language model (`{architecture}`) trained with flame {flame_version()}: step {step} of the "
             f"run `{_name(dump_folder)}`, weights in {dtype}.", ""]
    lines += [f"Exported format: {export_choice}.", ""] if export_choice else []
    lines += _base_line(run.get("model", {}).get("init_from"), dump_folder) + ["```python"]
    if not standard:
        lines.append(LOAD_FLAME)
    lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'model = AutoModelForCausalLM.from_pretrained("<repo id or folder>")',
              'tokenizer = AutoTokenizer.from_pretrained("<repo id or folder>")', "```", "", "## Architecture", ""]
    shape = [("model_type", f"`{architecture}`")]
    for label, attributes in _SHAPE:
        value = next((getattr(config, a) for a in attributes if getattr(config, a, None) is not None), None)
        if value is not None:
            shape.append((label, f"{value:,}" if isinstance(value, int) else str(value)))
    context = training.get("context_len") or training.get("seq_len")
    if context:
        shape.append(("context trained", f"documents of up to {context:,} tokens, rows of {training.get('seq_len'):,}"))
    shape.append(("parameters", f"{params:,} ({params - embeddings:,} without the input embeddings)"))
    lines += _table(shape) + ["", "## Training", ""]

    tokens = run_record.tokens_at(records, step)
    loss = run_record.last(records, run_record.LOSS, step)
    facts = [("steps", f"{step:,}"), ("tokens trained", "n/a" if tokens is None else f"{round(tokens):,}")]
    facts.append(("training loss", "n/a" if loss is None else f"{_number(loss[1])} at step {loss[0]} (mean over the steps since the log line before)"))
    for label, key in (("validation loss", run_record.VALIDATION_LOSS), ("validation bits per byte", run_record.VALIDATION_BPB)):
        if found := run_record.last(records, key, step):
            facts.append((label, f"{_number(found[1])} (step {found[0]})"))
    facts += _data_rows(training, records, step, dump_folder)
    optimizer, schedule = run.get("optimizer", {}), run.get("lr_scheduler", {})
    if optimizer:
        facts.append(("optimizer", f"{optimizer.get('name')} lr {optimizer.get('lr')}, weight decay "
                                   f"{optimizer.get('weight_decay')}; warmup {schedule.get('warmup_steps')} steps, "
                                   f"{schedule.get('decay_type')} decay to {schedule.get('min_lr_factor')} x lr"))
    lines += _table(facts)

    scores = run_record.eval_scores(dump_folder, records).get(step)
    if scores:
        lines += ["", "## Evaluation", "", f"lm-evaluation-harness scores of this step (`eval/step-{step}/`):", ""]
        lines += _table([(f"`{task}`", f"{value:.4f}") for task, value in scores.items()], ("task/metric", "score"))

    command = run_record.command(dump_folder)
    lines += ["", "## Command", ""]
    if command:
        lines += ["Local paths show relative to the dump folder or by their base names.", "", "```bash",
                  _portable_command(command, dump_folder), "```"]
    else:
        lines.append("Not recorded (a launch without train.sh): `job_config.json` in the dump folder holds the whole job.")
    lines += ["", "Exported by `python -m flame.utils.convert_dcp_to_hf`; the run's curves: `curves.png` in its dump folder.", ""]
    data = card_data(dump_folder, step, model, config, run, exported_as)
    return str(ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(lines)))

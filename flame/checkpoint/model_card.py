"""The model card (README.md) of an HF export, derived from the run's dump folder.

What the exported model is (architecture, parameters), how it was trained (tokens, data and
their mix, the command line, flame's version), and how well (the training loss and, when the
run logged them, validation loss and bits per byte at the exported step; lm-eval scores of that
step from <dump>/eval/step-N/). Everything comes from the dump folder's job_config.json,
metrics.jsonl, eval/ and attempts/: nothing is written there.
"""

import functools
import os
import subprocess
from importlib import metadata

import torch
from transformers import PretrainedConfig

from flame.base import run_record

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


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return lines + [f"| {name} | {value} |" for name, value in rows]


def _number(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _data_rows(training: dict, records: dict, step: int) -> list[tuple[str, str]]:
    sources = [s.strip() for s in str(training["dataset"]).split(",")] if training.get("dataset") else []

    def per_source(key: str) -> list[str]:
        values = str(training.get(key) or "").split(",")
        return [values[i].strip() if i < len(values) else "" for i in range(len(sources))]

    names, splits, files, probs = (per_source(k) for k in ("dataset_name", "dataset_split", "data_files", "data_probs"))
    rows = []
    for source, name, split, data_files, prob in zip(sources, names, splits, files, probs):
        details = [f"config {name}" if name else "", f"split {split or 'train'}", f"files {data_files}" if data_files else "",
                   f"probability {prob} of {training.get('mix_unit', 'documents')}" if prob else ""]
        rows.append((f"source `{source}`", ", ".join(d for d in details if d)))
    row = records.get(max((s for s in records if s <= step), default=step), {})
    tokens = {key[5:-7]: value for key, value in row.items() if key.startswith("data/") and key.endswith("/tokens")}
    total = sum(tokens.values())
    if total:
        rows.append(("tokens per source", ", ".join(f"{name} {value:,} ({100 * value / total:.1f}%)"
                                                    for name, value in tokens.items())))
    return rows


def render(
    dump_folder: str, step: int, model: torch.nn.Module, config: PretrainedConfig, run: dict,
    exported_as: str | None = None, dtype: str = "float32",
) -> str:
    """The card's markdown for ``model`` (the exported weights, of ``config``) at ``step`` of the run in ``dump_folder``.

    ``run`` is the run's job config (job_config.json, {} if none); ``exported_as`` the
    architecture the weights were written under when not the model's own (``llama``).
    """
    try:
        records = run_record.metrics(dump_folder)
    except ValueError:  # no metrics.jsonl (a run that logged nothing): the card says what it can
        records = {}
    training = run.get("training", {})
    name = os.path.basename(os.path.normpath(os.path.abspath(dump_folder)))
    architecture = config.model_type + (f", exported as `{exported_as}`" if exported_as else "")
    params = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel() if model.get_input_embeddings() is not None else 0
    standard = exported_as is not None or config.model_type in ("llama", "mistral", "qwen2", "qwen3", "gpt2")

    lines = ["---", "library_name: transformers", "tags:", "- flame", f"- {config.model_type}", "---", "",
             f"# {name}", "",
             f"A causal language model (`{architecture}`) trained with flame {flame_version()}: step {step} of the "
             f"run in `{os.path.abspath(dump_folder)}`, weights in {dtype}.", "", "```python"]
    if not standard:
        lines.append(LOAD_FLAME)
    lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
              'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "", "## Architecture", ""]
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
    facts += _data_rows(training, records, step)
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
        lines += ["```bash", command, "```"]
    else:
        lines.append("Not recorded (a launch without train.sh): `job_config.json` in the dump folder holds the whole job.")
    lines += ["", "Exported by `python -m flame.utils.convert_dcp_to_hf`; the run's curves: `curves.png` in its dump folder.", ""]
    return "\n".join(lines)

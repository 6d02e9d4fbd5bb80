"""Average a run's last checkpoints into one Hugging Face model, and score each beside the average.

    flame average exp/run [--last 4 | --steps 3000,3500,4000] [--weights uniform|linear|1,2,3] [--out exp/run/hf-avg]
                          [--checkpoint exp/anneal/checkpoint/step-0]

Weight averaging of the last steps of a constant-lr (WSD stable) phase approximates the decay phase it saves,
and beats the last step alone on held-out loss (Megatron, OLMo and others report it). Each step is read as the
export reads it (its files checked against its manifest, fp32 on the CPU, one step in memory at a time beside
the running sum), weighted (``uniform``, ``linear``: the newest weighs most, or given numbers), and the average
is exported like ``flame export`` (safetensors, config, tokenizer, model card; written beside the destination
and swapped in); with ``--checkpoint`` it is also written as a model-only checkpoint step, from which a run
whose dump folder holds it starts (like convert_hf_to_dcp's). Then every averaged step and the average are scored on the same documents: the first
``--documents`` of the run's validation dataset (or its first training dataset, whose first documents a run with
--validation.holdout_documents never trained on), as mean loss per target token, in one table.
"""

import os
import sys

import torch

from flame.base.cli import ArgumentParser
from flame.base.errors import ConfigError, gist
from flame.checkpoint import destination, model_card
from flame.checkpoint.export import (
    DTYPES,
    export,
    load_hf_model_from_dcp,
    run_settings,
)
from flame.checkpoint.import_hf import write_model_step
from flame.checkpoint.manifest import complete_steps
from flame.data.sources import SourceSpec, document_column, load_source
from flame.data.tokenizer import load_tokenizer
from flame.models import load_model_config


def chosen_steps(folder: str, last: int | None, steps: str | None) -> list[int]:
    """The complete steps to average: the last ``last`` ones, or those named; ConfigError naming what is there."""
    complete = complete_steps(folder)
    if not complete:
        raise ConfigError(f"{folder} holds no complete checkpoint to average")
    if steps:
        try:
            named = [int(step) for step in steps.split(",")]
        except ValueError:
            raise ConfigError(f"--steps {steps}: give step numbers, comma-separated") from None
        if missing := [step for step in named if step not in complete]:
            raise ConfigError(f"--steps: step {missing[0]} is not a complete checkpoint of {folder}; it holds "
                              f"{', '.join(map(str, complete))}")
        return named
    if last < 2 or last > len(complete):
        raise ConfigError(f"--last {last}: average 2 to {len(complete)} steps (the complete ones of {folder}: "
                          f"{', '.join(map(str, complete))})")
    return complete[-last:]


def step_weights(spec: str, count: int) -> list[float]:
    """Normalized weights of ``count`` steps, oldest first."""
    if spec == "uniform":
        raw = [1.0] * count
    elif spec == "linear":
        raw = [float(i + 1) for i in range(count)]
    else:
        try:
            raw = [float(w) for w in spec.split(",")]
        except ValueError:
            raise ConfigError(f"--weights {spec}: uniform, linear, or one number per step, comma-separated") from None
        if len(raw) != count or any(not w >= 0 for w in raw) or not sum(raw) > 0:
            raise ConfigError(f"--weights {spec}: give {count} numbers >= 0 (one per step, oldest first), not all 0")
    total = sum(raw)
    return [w / total for w in raw]


def averaged_model(checkpoints: list[str], weights: list[float], config) -> torch.nn.Module:
    """An HF model holding sum(weight x step's weights), read one step at a time."""
    model, total = None, None
    for checkpoint, weight in zip(checkpoints, weights):
        step_model = load_hf_model_from_dcp(checkpoint, config, runnable=True)
        state = step_model.state_dict()
        if total is None:
            model, total = step_model, {name: tensor.detach().clone().mul_(weight) for name, tensor in state.items()}
        else:
            for name, tensor in state.items():
                total[name].add_(tensor.detach(), alpha=weight)
    model.load_state_dict(total)
    return model


@torch.no_grad()
def mean_loss(model: torch.nn.Module, documents: list[list[int]]) -> float:
    """Mean next-token loss per target token over ``documents`` (each scored alone)."""
    loss, targets = 0.0, 0
    model.eval()
    for ids in documents:
        if len(ids) < 2:
            continue
        tokens = torch.tensor(ids)[None]
        logits = model(tokens).logits.float()
        loss += torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum").item()
        targets += len(ids) - 1
    return loss / targets if targets else float("nan")


def scoring_documents(run: dict, tokenizer, count: int, max_tokens: int) -> tuple[str, list[list[int]]]:
    """(where they come from, the token ids of the first ``count`` documents) of the run's validation or training data."""
    validation, training = run.get("validation", {}), run.get("training", {})
    path = validation.get("dataset") or (training.get("dataset") or "").split(",")[0]
    if not path:
        raise ConfigError("the run names no dataset to score on")
    spec = SourceSpec(path)
    dataset = load_source(spec, streaming=False)
    column, token_ids = document_column(dataset, spec, validation.get("text_column") or training.get("text_column"))
    values = dataset.select(range(min(count, len(dataset))))[column]
    documents = [list(v) if token_ids else tokenizer(v, add_special_tokens=False)["input_ids"] for v in values]
    return path, [ids[:max_tokens] for ids in documents]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame average", description=__doc__.split("\n")[0])
    parser.add_argument("folder", path=True, help="the run's dump folder")
    parser.add_argument("--last", type=int, default=4, help="average the last N complete steps (default 4)")
    parser.add_argument("--steps", help="the steps to average, comma-separated (instead of --last)")
    parser.add_argument("--weights", default="uniform",
                        help="uniform (default), linear (the newest weighs most), or one number per step, oldest first")
    parser.add_argument("--out", path=True, help="the HF export of the average (default: <folder>/hf-avg)")
    parser.add_argument("--checkpoint", path=True,
                        help="also write the average as a model-only checkpoint step here (e.g. <new dump>/checkpoint/step-0)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the run's checkpoint.export_dtype)")
    parser.add_argument("--documents", type=int, default=32,
                        help="documents each step and the average are scored on (default 32; 0: no scores)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.folder, "hf-avg")
    try:
        run = run_settings(args.folder)
        checkpoint_folder = os.path.join(args.folder, run.get("checkpoint", {}).get("folder", "checkpoint"))
        steps = chosen_steps(checkpoint_folder, args.last, args.steps)
        weights = step_weights(args.weights, len(steps))
        target = destination.check(out, f"--out {out}" if args.out else f"the average's folder {out}")
        if args.checkpoint and os.path.exists(args.checkpoint) and os.listdir(args.checkpoint):
            raise ConfigError(f"--checkpoint {args.checkpoint} exists and is not empty; give a new step folder "
                              "(e.g. <new dump folder>/checkpoint/step-0)")
        config = load_model_config(run["model"]["config"])
        tokenizer = load_tokenizer(run["model"]["tokenizer_path"])
        checkpoints = [os.path.join(checkpoint_folder, f"step-{step}") for step in steps]
        model = averaged_model(checkpoints, weights, config)
        dtype = DTYPES[args.dtype or run.get("checkpoint", {}).get("export_dtype", "float32")]
        card = model_card.render(args.folder, steps[-1], model, config, run, dtype=str(dtype).removeprefix("torch."))
        scores = []
        if args.documents:
            source, documents = scoring_documents(run, tokenizer, args.documents,
                                                  run.get("training", {}).get("seq_len") or 2048)
            scores = [(f"step {step} (x{weight:.3g})", mean_loss(load_hf_model_from_dcp(checkpoint, config, runnable=True), documents))
                      for step, weight, checkpoint in zip(steps, weights, checkpoints)]
            scores.append(("average", mean_loss(model, documents)))
        export(model, tokenizer, target, dtype, "5GB", card)
        if args.checkpoint:
            write_model_step(model, args.checkpoint)  # fp32: the weights a run starts from
    except ConfigError as error:
        print(f"flame average: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"flame average: error: {gist(error)}; nothing of the average was kept", file=sys.stderr)
        return 1
    also = f" and the checkpoint step {args.checkpoint}" if args.checkpoint else ""
    print(f"averaged steps {', '.join(map(str, steps))} of {args.folder} ({args.weights}) into {out}{also}")
    if scores:
        print(f"mean loss per target token on the first {args.documents} documents of {source}:")
        for name, loss in scores:
            print(f"  {name:<24} {loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a Hugging Face model's weights as a flame step-0 checkpoint (continual pretraining).

The one-command way is ``--model.init_from <hf dir>`` (flame.models.init_from), which reads the
safetensors into the run's shards; this converter is the explicit alternative, and loads through
transformers' own ``from_pretrained`` (``.bin`` files, renamed keys).

    python -m flame.utils.convert_hf_to_dcp --model <hf dir or hub name> --checkpoint exp/run/checkpoint/step-0

A run whose dump folder holds this step-0 checkpoint starts from these weights (model only:
optimizer, schedule and data start fresh). Use the same model config for the run
(``--model.config <hf dir>`` works directly). The step gets its manifest (flame.checkpoint.manifest) like
every step flame saves.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from flame.checkpoint import manifest
from flame.models import load_model_config
from flame.base.cli import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame convert hf_to_dcp", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, path=True, help="HF model directory (or a hub name in the local cache)")
    parser.add_argument("--checkpoint", required=True, path=True, help="checkpoint directory to create, e.g. <dump>/checkpoint/step-0")
    args = parser.parse_args(argv)

    if os.path.exists(args.checkpoint) and os.listdir(args.checkpoint):
        print(f"convert_hf_to_dcp: error: {args.checkpoint} exists and is not empty; choose a new path", file=sys.stderr)
        return 2
    try:
        # the config through flame (which imports fla when the model is fla's), then the weights
        config = load_model_config(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=torch.float32)
    except (OSError, ValueError) as error:
        print(f"convert_hf_to_dcp: error: cannot load {args.model}: {error}", file=sys.stderr)
        return 2
    count = write_model_step(model, args.checkpoint)
    print(f"wrote {count} tensors of {args.model} to {args.checkpoint}")
    return 0


def write_model_step(model: torch.nn.Module, checkpoint: str) -> int:
    """``model``'s weights as a model-only checkpoint step at ``checkpoint`` (a run whose dump folder holds it
    starts from them), its manifest written last; the number of tensors."""
    state_dict = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    dcp.save(state_dict, checkpoint_id=checkpoint)
    manifest.record(checkpoint)  # last: it marks the step complete
    return len(state_dict)


if __name__ == "__main__":
    sys.exit(main())

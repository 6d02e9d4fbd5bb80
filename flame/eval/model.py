"""The model flame.eval scores: an HF export, or a DCP step of a dump folder loaded in memory, as lm-eval's HFLM.

A dump folder's step loads as the HF export of that step would (flame.checkpoint.export:
the run's model config, tokenizer and export dtype, LoRA adapters merged), without writing a
file. ``FlameLM`` is lm-eval's own HF model class around that model; it only adds data
parallelism over flame.eval's process group and the batch policy of the model type.
"""

import logging
import os
from dataclasses import dataclass

import torch
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from flame.base.dump_folder import RUN_CONFIG_FILE
from flame.base.errors import ConfigError, gist
from flame.checkpoint.export import find_step, load_adapters, load_hf_model_from_dcp, run_settings
from flame.data.tokenizer import load_tokenizer
from flame.models import load_model_config, lora
from flame.models.support import support_for

logger = logging.getLogger("flame.eval")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --model_args keys that build or place a model from a path: flame.eval builds the model itself
_PATH_ARGS = ("pretrained", "revision", "subfolder", "parallelize", "tp_plan", "peft", "delta", "autogptq", "gptqmodel",
              "gguf_file", "device_map", "max_memory_per_gpu", "max_cpu_memory", "offload_folder", "backend",
              "trust_remote_code", "use_fast_tokenizer", "tokenizer")


@dataclass
class Source:
    """What --model names: an HF model directory, or a step of a dump folder."""

    path: str
    dump_folder: str | None  # the run's dump folder (None: a plain HF directory)
    step: int | None  # the dump folder's step

    @property
    def label(self) -> str:
        return self.path if self.step is None else f"{self.path} step {self.step}"


def is_dump_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_CONFIG_FILE))


def resolve(path: str, step: int | None) -> Source:
    """The model ``path`` names (and ``step``, for a dump folder: default its latest complete step)."""
    if not os.path.isdir(path):
        raise ConfigError(f"--model {path} is not a directory; give an HF model directory or a run's dump folder")
    if is_dump_folder(path):
        _, found = find_step(path, run_settings(path), -1 if step is None else step)
        return Source(path, path, found)
    if step is not None:
        raise ConfigError(f"--step {step}: {path} is an HF model directory, not a dump folder (no job_config.json); drop --step")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model {path} holds neither config.json (an HF model) nor job_config.json (a dump folder)")
    return Source(path, None, None)


def load(source: Source, dtype: str, device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The model (in ``dtype``: a name, or "auto" for the export's own) on ``device``, and its tokenizer."""
    if source.dump_folder is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=DTYPES.get(dtype, "auto"))
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot load the HF model in {source.path}: {gist(error)}") from None
        tokenizer = load_tokenizer(source.path)
    else:
        model, tokenizer = _load_step(source, dtype)
    return model.to(device).eval(), tokenizer


def _load_step(source: Source, dtype: str) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    run = run_settings(source.dump_folder)
    config_path, tokenizer_path = run["model"]["config"], run["model"]["tokenizer_path"]
    checkpoint, _ = find_step(source.dump_folder, run, source.step)
    config = load_model_config(config_path)
    model = load_hf_model_from_dcp(checkpoint, config, runnable=True)
    adapters = lora.LoraSettings.of(run.get("lora") or {})
    if adapters is not None:  # scored as the merged model
        model = load_adapters(model, adapters, checkpoint, lora.base_model_path(config_path)).merge_and_unload()
    dtype = run.get("checkpoint", {}).get("export_dtype", "float32") if dtype == "auto" else dtype
    return model.to(DTYPES[dtype]), load_tokenizer(tokenizer_path or config_path)


def check_model_args(model_args: dict) -> None:
    """Refuse --model_args that name or place a model: flame.eval loads --model itself."""
    if given := [key for key in model_args if key in _PATH_ARGS]:
        raise ConfigError(
            f"--model_args {', '.join(given)}: flame.eval loads the model of --model (and --step) itself; drop "
            f"{'them' if len(given) > 1 else 'it'} (dtype, max_length, add_bos_token, ... apply)"
        )
    if model_args.get("dtype", "auto") not in ("auto", *DTYPES):
        raise ConfigError(f"--model_args dtype={model_args['dtype']}: use auto, {', '.join(DTYPES)}")


def batch_size_for(model: torch.nn.Module, batch_size: int | str) -> int | str:
    """``batch_size``, or 1 for a model type whose layers do not honour padding (flame.models.support)."""
    record = support_for(model.config)
    if record.honours_padding or str(batch_size) == "1":
        return batch_size
    logger.warning(
        f"{record.name} does not keep the sequences of a padded batch apart ({record.not_isolated_because}): scoring "
        f"one sequence at a time (batch size 1, not {batch_size}), so that batching cannot change the scores"
    )
    return 1


def bucket_length(length: int) -> int:
    """The next power of two up to 512, then the next multiple of 512: a dozen lengths cover 0-4096."""
    return 1 << max(length - 1, 0).bit_length() if length <= 512 else -(-length // 512) * 512


class FlameLM(HFLM):
    """lm-eval's HF model around a model flame loaded, its requests shared over flame.eval's processes.

    HFLM shards the requests by rank itself only when it loads the model through accelerate;
    given a built model it runs alone. Here every process of a torchrun launch holds the model
    and scores its share (rank, world size and the gathers below); rank 0 aggregates.
    """

    def __init__(self, model, tokenizer, rank: int, world_size: int, **hflm_args):
        super().__init__(pretrained=model, tokenizer=tokenizer, **hflm_args)
        self._rank, self._world_size = rank, world_size

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """lm-eval's forward, on a GPU with the batch right-padded to one of a few lengths (``bucket_length``).

        Most fla kernels take the sequence length as a Triton compile-time constant, and lm-eval's
        batches come in every length, so each new length compiles every kernel again (about a
        second a batch). The added tokens are to the right of every real one, which a causal model
        cannot see, and their logits are cut off. On the CPU nothing compiles, so batches go as
        lm-eval makes them.
        """
        length = inps.shape[1]
        padded = min(bucket_length(length), max(self.max_length, length))
        if inps.device.type != "cuda" or attn_mask is not None or padded == length:
            return super()._model_call(inps, attn_mask, labels)
        filler = inps.new_full((inps.shape[0], padded - length), self.tokenizer.pad_token_id or 0)
        return super()._model_call(torch.cat([inps, filler], dim=1))[:, :length]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

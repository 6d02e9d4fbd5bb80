"""LoRA fine-tuning with PEFT's LoRA layers, for any HF/fla causal LM flame builds.

    --lora.rank 16 [--lora.alpha 32] [--lora.dropout 0.05] [--lora.targets q_proj,v_proj | all-linear]

- Build: PEFT's adapter layers go into the model flame built on the meta device, before it is
  parallelized (``add_adapters``, from flame.models.builder). The model keeps its class and its
  blocks; each targeted Linear becomes a ``lora.Linear`` holding it as ``base_layer``. Only the
  adapters require gradients, so torchtitan's optimizer builder (it takes the parameters that
  do) holds them alone; FSDP2 shards frozen and trainable parameters in one group and
  reduce-scatters only the gradients that exist; the gradient clip sees only those.
- Init: after the model's own init, which also reaches the adapters' Linears, every adapter
  gets PEFT's init again (``reset_adapters``: A kaiming-uniform, B zero, so training starts
  from the base model's function). A model-only load (--model.init_from, the step-0 checkpoint
  that convert_hf_to_dcp writes, or --checkpoint.initial_load_path) loads the base weights alone
  (flame.checkpoint.manager), so the adapters start from that init on top of them.
- Checkpoints: every checkpoint holds the frozen base weights (it is self-contained: the export
  and a resume read nothing else) under the plain model's names, and the adapters under the
  names of PEFT's adapter file without its ``base_model.model.`` prefix
  (``model.layers.0.self_attn.q_proj.lora_A.weight``), with their optimizer state: a resume is exact.
- Export (flame.checkpoint.export): the base model from the checkpoint, the adapters
  loaded into a PeftModel over it, saved in PEFT's format or merged into a plain model.

Adapters work only where the model calls its Linear: a layer whose weight a fused kernel reads
directly would skip the adapter. fla's gated MLPs do that with their down projection; flame
unfuses those that get an adapter. Any other such layer is found by its adapter getting no
gradient in the first step (``check_gradients``), which stops the run in one line.
"""

import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.pytorch_utils import Conv1D

from flame import compat
from flame.base.errors import ConfigError
from flame.models.registry import layer_kinds, names_layer

ADAPTER = "default"  # PEFT's name for a model's one adapter
ALL_LINEAR = "all-linear"
# what PEFT adds to a weight's name: the wrapped Linear's ``base_layer``, the adapter's name
_PEFT_PARTS = re.compile(r"\.base_layer(?=\.)|(?<=\.lora_[AB])\.default(?=\.)")
_ADAPTER_WEIGHT = re.compile(r"\.lora_[AB]\.")


@dataclass(frozen=True)
class LoraSettings:
    """The --lora.* settings a model is built with (None where LoRA is off)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @classmethod
    def of(cls, lora: Any) -> "LoraSettings | None":
        """From the job config's ``lora`` section, or the dict of it that a run saved in job_config.json."""
        get = lora.get if isinstance(lora, dict) else lambda name: getattr(lora, name)
        if get("rank") is None:
            return None
        targets = tuple(entry.strip() for entry in get("targets").split(","))
        return cls(rank=int(get("rank")), alpha=float(get("alpha")), dropout=float(get("dropout")), targets=targets)

    def peft_config(self, base_model: str | None = None):
        from peft import LoraConfig

        targets = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
            task_type="CAUSAL_LM", base_model_name_or_path=base_model,
        )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))  # what PEFT's LoRA wraps as a linear layer


def linear_layers(model: nn.Module) -> list[str]:
    """The names of the layers adapters can go on: every Linear (and HF's Conv1D) but the output head."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules() if _is_linear(module) and module is not head]


def resolve_targets(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The layers ``settings.targets`` names (PEFT's rule: a name, or its last parts); ConfigError when an entry names none."""
    layers = linear_layers(model)
    if settings.targets == (ALL_LINEAR,):
        return layers
    chosen: list[str] = []
    for entry in settings.targets:
        matched = [name for name in layers if names_layer(name, entry)]
        if not matched:
            head = next((name for name, module in model.named_modules() if module is model.get_output_embeddings()), None)
            if head is not None and names_layer(head, entry):
                raise ConfigError(
                    f"--lora.targets {entry}: flame puts adapters on the linear layers of the model body, not on the "
                    "output head (flame's fused loss reads the head's weight directly); leave it out"
                )
            raise ConfigError(
                f"--lora.targets {entry} matches no linear layer of {model.config.model_type}; its linear layers are "
                f"{', '.join(layer_kinds(model, layers))}: name some of them (or their last parts), or use all-linear"
            )
        chosen.extend(name for name in matched if name not in chosen)
    return chosen


def add_adapters(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Put PEFT's LoRA layers on ``model``'s targets and freeze everything else; returns the adapted layers' names."""
    from peft import inject_adapter_in_model

    targets = resolve_targets(model, settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on unknown architectures: the check below covers them
        inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    adapted = adapted_layers(model)
    if sorted(adapted) != sorted(targets):  # PEFT's reading of the targets is the one that counts
        raise ConfigError(
            f"--lora.targets {','.join(settings.targets)}: PEFT adapted {len(adapted)} layers where flame resolved "
            f"{len(targets)}; name the layers in full (e.g. model.layers.0.self_attn.q_proj)"
        )
    for module in adapted_modules(model):
        # PEFT casts each adapter's input to the adapter's weight dtype: under bf16 autocast that is a float32 copy
        # of the input (the base's bf16 output), which autocast casts back to bf16 for the adapter's matmul, once per
        # adapted layer (q, k and v each copy the same input). Left as it comes, the matmul is the same; where no
        # autocast runs (float32 compute, FSDP's bf16 weights) input and weight already share a dtype
        module.cast_input_dtype_enabled = False
    compat.fla.down_projections_called(model, set(map(id, adapted_modules(model))))
    compat.peft.adapter_added_in_its_matmul()
    return adapted


def adapted_modules(model: nn.Module) -> list[nn.Module]:
    """The model's LoRA layers (none unless PEFT is in use)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def adapted_layers(model: nn.Module) -> list[str]:
    layers = set(map(id, adapted_modules(model)))
    return [name for name, module in model.named_modules() if id(module) in layers]


def reset_adapters(model: nn.Module) -> None:
    """PEFT's own init of every adapter (A kaiming-uniform, B zero), after the model's init reached them too."""
    for module in adapted_modules(model):
        module.reset_lora_parameters(ADAPTER, True)


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold the frozen base model's floating-point weights in ``dtype``, the compute dtype; returns how many.

    They get no gradient and no optimizer state, and every matmul reads them in the compute dtype
    anyway (FSDP's mixed precision casts each block's as it gathers it, autocast keeps a cast copy
    of each): held in it, they take half of float32's memory, and neither cast runs. Called on the
    model before it is sharded (on the meta device, so float32 copies never exist); tied weights stay
    one parameter. Checkpoints then hold the base in ``dtype``; loads cast to the weights' dtype.
    """
    cast: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # the old parameter kept alive: its id stays unique
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in cast:
                cast[id(param)] = (param, nn.Parameter(param.detach().to(dtype), requires_grad=False))
            module._parameters[name] = cast[id(param)][1]
    return sum(new.numel() for _, new in cast.values())


def adapter_params(model: nn.Module, settings: LoraSettings) -> int:
    """The parameters the adapters of ``settings`` add to ``model`` (A: rank x in, B: out x rank per layer),
    counted without adding them."""
    modules = dict(model.named_modules())
    total = 0
    for name in resolve_targets(model, settings):
        weight = modules[name].weight  # Linear: out x in; HF's Conv1D: in x out
        total += settings.rank * sum(weight.shape)
    return total


def describe(model: nn.Module, settings: LoraSettings) -> str:
    """One line for the log: trainable and total parameters, and what got adapters."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = adapted_layers(model)
    kinds = ", ".join(layer_kinds(model, layers))
    return (
        f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.2f}%): rank "
        f"{settings.rank} adapters (alpha {settings.alpha:g}, dropout {settings.dropout:g}) on {len(layers)} layers ({kinds}); "
        "every other weight is frozen"
    )


def check_gradients(model_parts: list[nn.Module], device: torch.device,
                    graded: Callable[[nn.Parameter], bool] | None = None) -> None:
    """After the first backward: ConfigError (on every rank) if an adapter got no gradient (``graded``: whether a
    parameter got one, where its ``.grad`` does not say: streamed weights' gradients go to the host).

    Such an adapter sits on a layer whose weight a fused kernel reads directly, so it changes nothing.
    """
    graded = graded or (lambda param: param.grad is not None)
    missing = [
        name.split(".lora_")[0] for part in model_parts for name, param in part.named_parameters()
        # a rank whose FSDP shard of an adapter is empty (more ranks than rows) holds no gradient for it
        if param.requires_grad and not graded(param) and _local(param).numel()
    ]
    count = torch.tensor([len(missing)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count)  # every rank stops alike, a pipeline stage without such a layer too
    if count.item():
        layers = ", ".join(dict.fromkeys(missing)) or "layers of another pipeline stage"
        raise ConfigError(
            f"the LoRA adapters of {layers} got no gradient in the first step: the model reads those layers' weights "
            "directly (a fused kernel), past the adapter; leave them out of --lora.targets"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def checkpoint_name(name: str) -> str:
    """A parameter's name in checkpoints: without ``base_layer`` (the plain model's name) and without the adapter name."""
    return _PEFT_PARTS.sub("", name)


def is_adapter_weight(name: str) -> bool:
    return bool(_ADAPTER_WEIGHT.search(name))


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict under the names checkpoints use."""
    return {checkpoint_name(name): tensor for name, tensor in model.state_dict().items()}


def base_model_path(config_path: str) -> str:
    """What an adapter names as its base model: the folder ``config_path`` names (a config.json's folder), the
    run's --model.init_from or else its --model.config."""
    path = os.path.abspath(config_path)
    return os.path.dirname(path) if os.path.basename(path) == "config.json" else path


def holds_weights(path: str) -> bool:
    """Whether ``path`` is a model directory with its weights (what from_pretrained loads)."""
    return os.path.isdir(path) and any(
        name.endswith((".safetensors", ".bin")) and name.startswith(("model", "pytorch_model")) for name in os.listdir(path)
    )

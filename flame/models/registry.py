"""Where model types come from: transformers, custom_models/ (imported with flame.models), and fla.

``import fla`` costs ~1.5 s (it imports all its layers, kernels and models), so flame imports it
only for a config that needs it: one whose model_type is fla's, or one transformers does not know
(the unknown-type error then lists fla's types too). fla re-registers a few of transformers' own
types ("bitnet", "mamba", "mamba2") over HF's; in flame those names mean fla's models, as they
did when fla was imported at startup. fla's types are read from its sources, without importing it.
flame's changes to fla (flame.compat.fla, flame.compat.mamba_ssm) apply here, right after that
import, and flame's attention joins transformers' registry when the first model type resolves.
"""

import functools
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from flame import compat
from flame.base.errors import ConfigError
from flame.models.kernels import attention, flash_attn_internals, mamba, mamba2

# the class attribute each fla config declares, e.g. ``model_type = 'gla'`` in fla/models/gla/configuration_gla.py
_MODEL_TYPE = re.compile(r"""^\s+model_type\s*=\s*['"](\w+)['"]""", re.MULTILINE)


@functools.cache
def fla_model_types() -> frozenset[str]:
    """The model types fla registers with transformers, found without importing fla."""
    # fla is a top-level name: finding it imports nothing
    spec = importlib.util.find_spec("fla")
    types = set()
    for root in spec.submodule_search_locations if spec else []:
        for source in Path(root).glob("models/*/configuration_*.py"):
            types.update(_MODEL_TYPE.findall(source.read_text()))
    return frozenset(types)


# flame's stand-ins for the flash-attn calls of fla's softmax-attention layers
FLASH_ATTN = compat.fla.FlashAttn(
    flash_attn_func=attention.flash_attn_func,
    flash_attn_varlen_func=attention.flash_attn_varlen_func,
    varlen_forward=flash_attn_internals.varlen_forward,
    varlen_backward=flash_attn_internals.varlen_backward,
)


@functools.cache
def import_fla() -> None:
    """Import fla once: it registers its model types; then flame's changes to fla and mamba_ssm apply
    (the one place they do: flame.compat.apply_after_fla_import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns at import when no GPU is present
        import fla  # noqa: F401
    compat.apply_after_fla_import(FLASH_ATTN, mamba.mamba_mix, mamba2.forward_keeping_documents_apart)


def ensure_model_type(model_type: str) -> None:
    """Make ``model_type`` resolve through transformers' Auto classes as flame means it (importing fla if needed).

    Models of the type then build with flame's attention (``attn_implementation="flame"``). fla is
    imported for its own types and unknown ones; where something imported it already (a custom
    architecture built from fla's layers), its layers get flame's changes too.
    """
    compat.transformers.attention_implementation(attention.HF_ATTENTION, attention.hf_document_attention)
    if model_type in fla_model_types() or model_type not in CONFIG_MAPPING or "fla" in sys.modules:
        import_fla()


def register_all() -> None:
    """Make every model type flame trains load and run through transformers' Auto classes (``flame.register``).

    custom_models/ registered (importing flame.models did it), flame's attention in transformers'
    registry, and fla with flame's changes where fla is installed: its softmax-attention layers
    then build and run on flame's attention instead of refusing to build without flash-attn.
    """
    compat.transformers.attention_implementation(attention.HF_ATTENTION, attention.hf_document_attention)
    if importlib.util.find_spec("fla") is not None:
        import_fla()


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The model ``config`` describes, on the meta device: its modules, weight names and shapes, no memory.

    What preflight checks and the HF export inspect; flame's builder changes none of these.
    """
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder blocks: the ModuleList holding most parameters (any HF layout)."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not stacks:
        raise ConfigError(f"{type(model).__name__} keeps no blocks in an nn.ModuleList; flame cannot shard it")
    return max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))


def names_layer(name: str, entry: str) -> bool:
    """Whether a layer list's ``entry`` (--lora.targets, --float8.filter_fqns) names the module ``name``: the name
    itself or its last parts ('o_proj', 'mlp.down_proj', 'model.layers.0.mlp.down_proj'), PEFT's rule."""
    return name == entry or name.endswith("." + entry)


def layer_kinds(model: nn.Module, names: list[str]) -> list[str]:
    """The names as a block calls them ('self_attn.q_proj'), each once: what such a list can give."""
    stack = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is stack)
    pattern = re.compile(rf"^{re.escape(prefix)}\.\d+\.")
    return list(dict.fromkeys(pattern.sub("", name) for name in names))

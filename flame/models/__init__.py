"""Models: any HF causal LM, every fla model type, and the architectures under custom_models/.

fla is imported only when a config needs it (flame.models.registry). The builder (and with it
torchtitan, which costs seconds to import) loads when one of its names is first used: loading an
export (``flame.register``) needs the registry and the attention only, and the HF export reads its
model config through flame.models.model_config, which needs no torchtitan.
"""

import importlib

import custom_models  # noqa: F401  registers user architectures
from flame.models.inputs import model_inputs

_BUILDER_NAMES = ("AnyFlavor", "FlameModelArgs", "build_model")
__all__ = [*_BUILDER_NAMES, "load_model_config", "model_inputs"]


def __getattr__(name: str):
    if name in _BUILDER_NAMES:
        return getattr(importlib.import_module("flame.models.builder"), name)
    if name == "load_model_config":  # without the builder: the export reads configs, and builds no torchtitan model
        return importlib.import_module("flame.models.model_config").load_model_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

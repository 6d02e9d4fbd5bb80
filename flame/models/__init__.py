"""Models: any HF causal LM, every fla model type, and the architectures under custom_models/.

fla is imported only when a config needs it (flame.models.registry).
"""

import custom_models  # noqa: F401  registers user architectures
from flame.models.builder import (
    AnyFlavor,
    FlameModelArgs,
    build_model,
    load_model_config,
)
from flame.models.inputs import model_inputs

__all__ = ["AnyFlavor", "FlameModelArgs", "build_model", "load_model_config", "model_inputs"]

"""Models: any HF causal LM, every fla model type, and the architectures under custom_models/.

fla is imported only when a config needs it (flame.models.registry).
"""

import sys

import custom_models  # noqa: F401  registers user architectures
from flame.models import registry

if "fla" in sys.modules:  # a custom architecture built from fla's layers: they get flame's attention too
    registry.import_fla()

from flame.models.builder import (  # noqa: E402
    AnyFlavor,
    FlameModelArgs,
    build_model,
    load_model_config,
)
from flame.models.inputs import model_inputs  # noqa: E402

__all__ = ["AnyFlavor", "FlameModelArgs", "build_model", "load_model_config", "model_inputs"]

"""Models: any HF causal LM, every fla model type, and the architectures under custom_models/.

fla is imported only when a config needs it (flame.models.registry). The builder
(flame.models.builder) imports torchtitan, which costs seconds: loading an export
(``flame.register``) needs the registry and the attention only, and reads its model config
through flame.models.model_config, so this package imports neither the builder nor torchtitan.
"""

import custom_models  # noqa: F401  registers user architectures
from flame.models.inputs import model_inputs
from flame.models.model_config import load_model_config

__all__ = ["load_model_config", "model_inputs"]

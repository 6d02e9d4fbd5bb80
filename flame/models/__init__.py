"""Models: any HF causal LM, every fla model type, and the architectures under custom_models/."""

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns at import when no GPU is present
    import fla  # noqa: F401  registers fla's model types with transformers' Auto classes

import custom_models  # noqa: F401, E402  registers user architectures
from flame.models import attention  # noqa: E402

attention.install_in_fla()  # fla's softmax-attention layers need flash-attn otherwise

from flame.models.builder import (  # noqa: E402
    AnyFlavor,
    FlameModelArgs,
    build_model,
    load_model_config,
)
from flame.models.inputs import model_inputs  # noqa: E402
from flame.models.parallelize import parallelize_model  # noqa: E402

__all__ = ["AnyFlavor", "FlameModelArgs", "build_model", "load_model_config", "model_inputs", "parallelize_model"]

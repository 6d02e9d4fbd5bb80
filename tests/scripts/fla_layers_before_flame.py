"""fla's attention layer imported before flame gets flame's attention once flame loads a model config.

    python tests/scripts/fla_layers_before_flame.py

A package under custom_models/ built from fla's layers imports fla before flame.models is done.
Importing flame changes nothing in fla; the first model config flame loads applies its changes
(flame.compat). Prints whether fla.layers.attn calls flame's flash_attn_varlen_func, before and
after that (test_models.py expects False, then True).
"""

import fla.layers.attn  # first: before flame.models exists

from flame.models.kernels import attention

from flame.models import load_model_config

print(getattr(fla.layers.attn, "flash_attn_varlen_func", None) is attention.flash_attn_varlen_func)
load_model_config("configs/llama_4M.json")
print(fla.layers.attn.flash_attn_varlen_func is attention.flash_attn_varlen_func)

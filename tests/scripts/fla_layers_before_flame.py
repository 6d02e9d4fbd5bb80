"""fla's attention layer imported before flame still gets flame's attention entry points.

    python tests/scripts/fla_layers_before_flame.py

A package under custom_models/ built from fla's layers imports fla before flame.models is done.
Prints True when fla.layers.attn calls flame's flash_attn_varlen_func (test_models.py checks it).
"""

import fla.layers.attn  # first: before flame.models exists

from flame.models import attention

print(fla.layers.attn.flash_attn_varlen_func is attention.flash_attn_varlen_func)

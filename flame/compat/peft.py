"""PEFT's seam: how a LoRA layer adds its adapter's product to the base layer's output.

Written for peft 0.21.2 (3rdparty/requirements.txt).
"""

import importlib

import torch
from torch import nn

from flame.compat.guard import Library, Target, patch

PEFT = Library("peft", "peft", "0.21.2")

_LORA_LINEAR = Target(PEFT, "peft.tuners.lora.layer", "Linear.forward", ("self", "x"))


def _vanilla_adapter(layer) -> str | None:
    """The one active adapter of a LoRA ``Linear`` whose forward is ``base(x) + B(A(x)) * scaling`` exactly (no
    dropout, variant such as DoRA, adapter bias or merge), else None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant or not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    if layer.lora_B[name].bias is not None:
        return None
    return name


@patch(PEFT, _LORA_LINEAR)
def adapter_added_in_its_matmul() -> None:
    """Add a LoRA layer's adapter product inside the adapter's second matmul.

    Upstream: ``result = result + lora_B(lora_A(dropout(x))) * scaling`` writes the adapter's product (tokens x
    the layer's outputs), scales it into a second tensor of that size and adds it into a third; the backward
    scales the output gradient again. Each of those is a pass over a tensor as large as the layer's output: a
    27B-shaped model adapted on all its linear layers at 8K tokens moves about 63 GB a pass, several passes a
    forward. flame: for a layer whose adapter is plain (no dropout, variant, adapter bias or merge), the product
    is accumulated into the base output by one ``addmm`` (beta 1, alpha ``scaling``): the same sum, rounded once.
    Any other layer runs upstream's forward. Applied to runs with LoRA adapters (flame.models.lora.add_adapters).
    """
    linear = importlib.import_module(_LORA_LINEAR.module).Linear
    original = linear.forward

    def forward(self, x, *args, **kwargs):
        name = None if args or kwargs else _vanilla_adapter(self)
        if name is None:
            return original(self, x, *args, **kwargs)
        self._check_forward_args(x)
        result = self.base_layer(x)
        if type(result) is not torch.Tensor:  # a DTensor (tensor parallelism): upstream's sum
            return original(self, x)
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        down = lora_a(self._cast_input_dtype(x, lora_a.weight.dtype))
        summed = torch.addmm(result.reshape(-1, result.shape[-1]), down.reshape(-1, down.shape[-1]), lora_b.weight.t(),
                             alpha=self.scaling[name])
        return summed.view(result.shape).to(result.dtype)

    forward.adds_in_the_matmul = True
    linear.forward = forward

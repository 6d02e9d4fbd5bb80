"""Training FLOPs per token, counted from the model itself.

    flops/token = 6 * (parameters used in matmuls)           forward + backward weight matmuls
                + 12 * layers * heads * head_dim * ctx      softmax attention, QK^T and AV

Embedding lookups are not matmuls and are not counted; a tied lm_head is counted once (it
is one parameter). ``ctx`` is the mean number of keys a query attends to under the causal
mask: (context_len + 1) / 2, i.e. only the FLOPs a causal kernel really does. The attention
term is added only for models whose layers are softmax attention (HF decoders and fla's
``transformer``); linear-attention/SSM layers contribute their matmul parameters.
"""

from torch import nn

# fla model types whose token mixer is softmax attention
_FLA_SOFTMAX_ATTENTION = {"transformer"}


def matmul_parameters(model: nn.Module) -> int:
    """Parameters of Linear/Conv1D-style modules, each parameter counted once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            seen[id(weight)] = weight.numel()
    return sum(seen.values())


def softmax_attention_dims(config) -> tuple[int, int, int] | None:
    """(layers, heads, head_dim) of softmax attention, or None for non-softmax mixers."""
    is_fla = type(config).__module__.startswith("fla.")
    if is_fla and config.model_type not in _FLA_SOFTMAX_ATTENTION:
        return None
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None)
    if not layers or not heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, heads, head_dim


def flops_per_token(model: nn.Module, context_len: int) -> int:
    flops = 6 * matmul_parameters(model)
    dims = softmax_attention_dims(model.config)
    if dims is not None:
        layers, heads, head_dim = dims
        flops += 12 * layers * heads * head_dim * (context_len + 1) / 2
    return int(flops)

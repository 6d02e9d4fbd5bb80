"""Training FLOPs, counted per layer type from the model itself.

    FLOPs = 6 x (matmul parameters) x tokens                   forward + backward weight matmuls
          + 12 x sum(heads x head_dim) x (attended pairs)     softmax attention: QK^T and AV
          + 3 x (state FLOPs per token) x tokens              linear attention / SSM token mixing

- Matmul parameters: weights of Linear and Conv1d modules (and HF's Conv1D); embedding
  lookups are not matmuls; a tied lm_head is one parameter, counted once. A MoE layer's stacked
  experts count top_k / num_experts of their weights (the active ones), its router in full
  (flame.models.moe).
- Frozen weights (LoRA's base model, flame.models.lora) get no weight gradient: 4 x instead
  of 6 x (forward and the gradient passed on to the adapters below). Leading blocks below
  every trained parameter (adapters on later blocks only) run no backward at all: their
  weights count 2 x, their token mixing a third of its term. (The first adapted block's own
  inputs need no gradient either; that the count ignores, under 1/layers of the frozen term.)
- Softmax attention (HF decoders' attention layers; the fla layers the model types' records
  name, flame.models.support): a query attends to itself and the earlier keys of its
  document (or of its sliding window). Under varlen the pairs are counted from the real
  document lengths of each batch (``batch_flops``); ``flops_per_token(context_len)`` assumes
  full context_len documents.
- Linear attention / SSMs, with chunk size C = 64, per head and token: reading and updating a
  dk x dv state, 4·dk·dv, plus the intra-chunk causal attention, C·(dk + dv); x3 for training.
  The head dims come from the layer (``head_k_dim``/``head_v_dim``, Mamba's state sizes).
- Sparse attention (NSA, MoBA) and layers whose state shape flame cannot read contribute their
  matmul parameters only; ``uncounted`` names them, and the log says so.
"""

from dataclasses import dataclass, field

from torch import nn

from flame.models import moe
from flame.models.inputs import is_fla_config
from flame.models.registry import decoder_layers
from flame.models.support import softmax_attention_layers

CHUNK_SIZE = 64


def _matmul_weights(model: nn.Module) -> dict[int, nn.Parameter]:
    """The weights of Linear/Conv1d-style modules, each counted once (by id)."""
    return {
        id(module.weight): module.weight for module in model.modules()
        if isinstance(module, (nn.Linear, nn.Conv1d)) or type(module).__name__ == "Conv1D"
    }


def untrained_prefix(model: nn.Module) -> int:
    """Leading decoder blocks that no gradient reaches: neither they nor the embeddings hold a trained parameter."""
    embeddings = model.get_input_embeddings()
    if embeddings is not None and any(p.requires_grad for p in embeddings.parameters()):
        return 0
    count = 0
    for block in decoder_layers(model):
        if any(p.requires_grad for p in block.parameters()):
            break
        count += 1
    return count


def causal_pairs(length: int, window: int | None) -> int:
    """(query, key) pairs a causal kernel computes for one document, keys within ``window``."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


@dataclass
class ModelFlops:
    dense_per_token: int  # matmuls and linear-attention/SSM terms: proportional to tokens
    attention_widths: dict = field(default_factory=dict)  # window (None = full) -> sum of heads x head_dim
    uncounted: list = field(default_factory=list)  # token mixers without a term
    matmul_params: int = 0
    frozen_matmul_params: int = 0  # of matmul_params: no weight gradient (LoRA's base model)
    matmul_flops: int = 0  # per token

    def attention_flops(self, document_lengths) -> float:
        """Softmax-attention FLOPs (forward + backward) of documents of these lengths."""
        return sum(
            12 * width * sum(causal_pairs(int(length), window) for length in document_lengths)
            for window, width in self.attention_widths.items()
        )

    def batch_flops(self, document_lengths) -> float:
        tokens = sum(int(length) for length in document_lengths)
        return self.dense_per_token * tokens + self.attention_flops(document_lengths)

    def flops_per_token(self, context_len: int) -> int:
        return int(self.dense_per_token + self.attention_flops([context_len]) / context_len)

    def describe(self) -> str:
        parts = ["6 x matmul params"]
        if self.frozen_matmul_params:
            parts = ["6 x trained and 4 x frozen matmul params (2 x below every trained one)"]
        if self.attention_widths:
            parts.append("causal softmax attention over each batch's real documents")
        if self.dense_per_token > self.matmul_flops:
            parts.append("linear-attention/SSM state terms")
        text = " + ".join(parts)
        if self.uncounted:
            text += f"; no token-mixing term for {', '.join(sorted(set(self.uncounted)))}"
        return text


def model_flops(model: nn.Module) -> ModelFlops:
    weights = _matmul_weights(model)
    blocks = decoder_layers(model)
    prefix = untrained_prefix(model)
    # the weights of blocks no gradient reaches: forward only
    below = {id(p) for block in list(blocks)[:prefix] for p in block.parameters()}
    matmul = sum((2 if key in below else 6 if w.requires_grad else 4) * w.numel() for key, w in weights.items())
    matmul += round(6 * moe.active_matmul_weights(model))  # a MoE layer's experts: the ones a token goes through
    flops = ModelFlops(
        dense_per_token=matmul, matmul_params=sum(w.numel() for w in weights.values()),
        frozen_matmul_params=sum(w.numel() for w in weights.values() if not w.requires_grad), matmul_flops=matmul,
    )
    config = model.config
    if not is_fla_config(config):
        _add_hf_attention(flops, config, prefix)
        return flops
    quadratic = softmax_attention_layers()  # fla layers whose cost grows with the square of the document length
    for index, block in enumerate(blocks):
        for mixer in block.children():
            if type(mixer).__module__.startswith("fla.layers."):
                _add_fla_mixer(flops, mixer, quadratic, 1 / 3 if index < prefix else 1)
    return flops


def _add_attention(flops: ModelFlops, window: int | None, width: float) -> None:
    flops.attention_widths[window] = flops.attention_widths.get(window, 0) + width


def _add_hf_attention(flops: ModelFlops, config, untrained: int) -> None:
    """The attention term of HF decoder layers; the first ``untrained`` run forward only (a third of it)."""
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        flops.uncounted.append(config.model_type)
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    for index, layer_type in enumerate(layer_types):
        width = heads * head_dim / 3 if index < untrained else heads * head_dim
        if layer_type == "full_attention":
            _add_attention(flops, None, width)
        elif layer_type == "sliding_attention":
            _add_attention(flops, config.sliding_window, width)
        else:
            flops.uncounted.append(f"{config.model_type} {layer_type} layers")


def _add_fla_mixer(flops: ModelFlops, mixer: nn.Module, quadratic: set[str], share: float) -> None:
    """An fla layer's token-mixing term, ``share`` of it (a third: the layer runs no backward)."""
    name = type(mixer).__name__
    heads = getattr(mixer, "num_heads", None)
    if name in quadratic:
        head_dim = getattr(mixer, "head_dim", None) or mixer.head_k_dim
        _add_attention(flops, getattr(mixer, "window_size", None), heads * head_dim * share)
        return
    state = _state_shape(mixer, heads)
    if state is None:
        flops.uncounted.append(name)
        return
    heads, key_dim, value_dim = state
    flops.dense_per_token += round(3 * share * heads * (4 * key_dim * value_dim + CHUNK_SIZE * (key_dim + value_dim)))


def _state_shape(mixer: nn.Module, heads: int | None) -> tuple[int, int, int] | None:
    """(heads, dk, dv) of a recurrent layer's per-head state, when the layer exposes it."""
    key_dim = getattr(mixer, "head_k_dim", None) or getattr(mixer, "head_dim", None)
    value_dim = getattr(mixer, "head_v_dim", None)
    if heads and key_dim and value_dim:
        return heads, key_dim, value_dim
    state_size = getattr(mixer, "ssm_state_size", None)
    if state_size and heads and getattr(mixer, "head_dim", None):  # Mamba2: heads x (state x head_dim)
        return heads, state_size, mixer.head_dim
    if state_size and getattr(mixer, "intermediate_size", None):  # Mamba: a state per channel
        return mixer.intermediate_size, state_size, 1
    return None

"""fla's ``transformer`` under llama's names: the same model as a ``LlamaForCausalLM``.

Tools that know only standard architectures (vLLM, SGLang, llama.cpp's converters) read a
llama checkpoint but not fla's ``transformer``. The two compute the same function: pre-norm
blocks of RMSNorm, rotary grouped-query softmax attention (rotate-half rotary over the whole
head, scale 1/sqrt(head_dim)) and a SiLU-gated MLP, a final RMSNorm and an LM head. Only the
names differ, and fla's config options llama has no counterpart for are refused (``check``).
Used by ``--checkpoint.export_as llama`` (checked at preflight) and
``python -m flame.utils.convert_dcp_to_hf --export_as llama``, and chosen by ``auto`` (the default,
``choose``): fla's transformer calls flash-attn, so under its own architecture it loads without flame
only where flash-attn is installed, while as llama it loads in plain transformers.
"""

import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig
from flame.base.errors import ConfigError
from flame.models.support import model_types_where, support_for

FORMATS = ("auto", "native", "llama")

# fla transformer option -> (its value llama can express, what llama lacks)
_FIXED_OPTIONS = {
    "qk_norm": (False, "norms of queries and keys"),
    "window_size": (None, "sliding-window attention"),
    "attnres_block_size": (None, "attention residuals"),
}

# fla's weight names -> llama's (the rest are the same: lm_head, model.norm, the projections)
_RENAMES = [
    (r"^model\.embeddings\.", "model.embed_tokens."),
    (r"^model\.layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
    (r"^model\.layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^model\.layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
]


def unexpressed(config: PretrainedConfig) -> str | None:
    """What of ``config``'s model llama's architecture cannot express (None: it expresses it exactly)."""
    if not support_for(config).exports_as_llama:
        types = ", ".join(support_for(name).name for name in model_types_where(lambda r: r.exports_as_llama))
        return f"only {types} exports as llama, not {config.model_type}"
    for option, (plain, missing) in _FIXED_OPTIONS.items():
        value = getattr(config, option, plain)
        if value != plain and not (plain is False and not value):
            return f"this transformer sets {option} {value!r}, and llama has no {missing}"
    if config.hidden_act not in ("swish", "silu"):
        return f"this transformer's MLP uses hidden_act {config.hidden_act!r}, and llama's gated MLP here is SiLU's"
    return None


def check(config: PretrainedConfig, flag: str = "--checkpoint.export_as llama") -> None:
    """Refuse, in one line, a model that llama's architecture cannot express exactly."""
    if (problem := unexpressed(config)) is not None:
        raise ConfigError(f"{flag}: {problem}; export it under its own architecture (native, or leave out "
                          "--export_as / --checkpoint.export_as) and load it after flame.register()")


def choose(config: PretrainedConfig, requested: str, flag: str, adapter: bool = False) -> tuple[str, str]:
    """(the format of ``config``'s export, why in words) for ``requested``: native or llama as given; auto: llama
    where the model's own architecture loads only with flash-attn and llama's expresses it exactly, else native.
    ``flag`` names where ``requested`` came from; ``adapter``: the export is a LoRA adapter, not a whole model."""
    callers = support_for(config).flash_attn_needed(config)
    needs = ", ".join(f"fla's {c.layer}" + (f" with {c.option}" if c.option else "") for c in callers)
    loads = f"loads only with flash-attn or after flame.register() ({needs})"
    if requested != "auto":
        own = f": its own architecture, which {loads}" if requested == "native" and callers else ""
        return requested, f"{flag} {requested}{own}"
    if not callers:
        return "native", f"{flag} auto: its own architecture, which loads without flash-attn"
    if adapter:
        return "native", f"{flag} auto: a LoRA adapter keeps its base model's architecture, which {loads}"
    if (problem := unexpressed(config)) is not None:
        return "native", f"{flag} auto: its own architecture, which {loads}; llama cannot express it ({problem})"
    return "llama", f"{flag} auto: llama, which loads in plain transformers; its own architecture {loads}"


def llama_config(config: PretrainedConfig, intermediate_size: int) -> LlamaConfig:
    """Llama's config of the same model; ``intermediate_size`` is the MLP width (fla derives it from hidden_ratio)."""
    heads = config.num_heads
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_kv_heads or heads,
        head_dim=config.hidden_size // heads,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta or 10000.0)},
        attention_bias=bool(config.qkv_bias),
        attention_dropout=0.0,
        mlp_bias=False,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


def llama_name(name: str) -> str:
    """A weight's name in llama's layout."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def as_llama(model: torch.nn.Module) -> LlamaForCausalLM:
    """``model`` (fla's TransformerForCausalLM, weights loaded) as a LlamaForCausalLM holding the same weights."""
    check(model.config)
    weights = {llama_name(name): tensor for name, tensor in model.state_dict().items()}
    width = weights["model.layers.0.mlp.gate_proj.weight"].shape[0]
    config = llama_config(model.config, width)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    if config.attention_bias:  # llama's attention_bias also gives o_proj a bias, which fla's has not: zero
        for index in range(config.num_hidden_layers):
            o_proj = f"model.layers.{index}.self_attn.o_proj"
            weights[f"{o_proj}.bias"] = weights[f"{o_proj}.weight"].new_zeros(config.hidden_size)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    missing, unexpected = llama.load_state_dict(weights, strict=False, assign=True)
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:  # a bug in the mapping: never write a half-mapped model
        raise RuntimeError(f"llama export: weights missing {missing}, unexpected {unexpected}; this is a bug in flame")
    llama.tie_weights()
    # its rotary frequencies are a buffer computed from the config, not a weight: build it for real
    llama.model.rotary_emb = type(llama.model.rotary_emb)(config=config)
    return llama.eval()

"""Read and check an HF model config JSON: what every path that builds or loads a model starts from.

Apart from flame.models.builder (which imports torchtitan, seconds): the HF export and the
conversions read configs without it.
"""

import difflib
import os
from types import SimpleNamespace

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from flame.base import hub
from flame.base.errors import ConfigError, gist
from flame.models.registry import ensure_model_type, fla_model_types


def load_model_config(path: str) -> PretrainedConfig:
    """The HF config at ``path`` (a config.json, a directory holding one, or a hub model's: the local HF cache first)."""
    try:
        if os.path.exists(path) or not hub.is_hub_name(path):
            config_dict, _ = PretrainedConfig.get_config_dict(path)
        else:
            config_dict, _ = hub.cache_first(f"model config {path}", hub.download_remedy(path),
                                             lambda: PretrainedConfig.get_config_dict(path))
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read model config {path}: {gist(error)}; fix it (a JSON object with a model_type)") from None
    except TypeError:  # transformers indexes the JSON as an object
        raise ConfigError(f"model config {path} is not a JSON object ({{\"model_type\": ..., ...}})") from None
    model_type = config_dict.get("model_type")
    if model_type is None:
        raise ConfigError(f"model config {path} has no 'model_type'; add one (e.g. \"llama\")")
    ensure_model_type(model_type)  # imports fla for its types and unknown ones, so the list below has fla's
    if model_type not in CONFIG_MAPPING:
        causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | fla_model_types()
        close = difflib.get_close_matches(str(model_type), causal_lms, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(  # transformers' own list holds hundreds of types, most of them no causal LM
            f"unknown model_type '{model_type}' in {path}{hint}; custom architectures go under custom_models/. "
            f"flame trains fla's {', '.join(sorted(fla_model_types()))} and transformers' causal LMs (llama, "
            "qwen2, qwen3, mistral, ...)"
        )
    check_model_sizes(SimpleNamespace(**config_dict), path)  # some fail inside transformers (a division by 0 heads)
    try:
        if os.path.isdir(path):
            config = AutoConfig.from_pretrained(path)  # as transformers loads a model directory
        else:
            config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    except Exception as error:  # transformers' own validation: a value of the wrong type, heads that do not fit ...
        raise ConfigError(f"model config {path} is not a valid {model_type} config: {gist(error)}; fix it there") from None
    check_model_sizes(config, path)  # again, with the defaults and the names the config class maps
    _check_causal(config, path)
    return config


def _check_causal(config: PretrainedConfig, path: str) -> None:
    """A config transformers has no causal LM for (T5), or an encoder's (BERT) whose causal head would attend to later
    tokens, trains no causal LM: refused before anything is built."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"model_type '{config.model_type}' ({path}) has no causal LM in transformers "
                          f"{'(an encoder-decoder) ' if getattr(config, 'is_encoder_decoder', False) else ''}and flame "
                          "trains causal LMs: give a decoder-only model's config")
    if getattr(config, "is_decoder", None) is False:  # only encoder families' configs have the attribute
        raise ConfigError(f"model_type '{config.model_type}' ({path}) is an encoder: its causal LM head attends to later "
                          "tokens unless the config says \"is_decoder\": true; set it there, or give a decoder-only "
                          "model's config")


# sizes that no model can have below 1, in HF's spellings and fla's
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_heads",
          "num_key_value_heads", "num_kv_heads", "head_dim", "max_position_embeddings")


def check_model_sizes(config: PretrainedConfig | SimpleNamespace, path: str) -> None:
    """Sizes the model cannot be built or run with, which transformers and fla let through to the ranks."""
    for name in _SIZES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{name} is {value} in the model config {path}; it must be at least 1")
    for heads, kv_heads in (("num_attention_heads", "num_key_value_heads"), ("num_heads", "num_kv_heads")):
        h, kv = getattr(config, heads, None), getattr(config, kv_heads, None)
        if isinstance(h, int) and isinstance(kv, int) and h % kv:
            raise ConfigError(
                f"{kv_heads} {kv} does not divide {heads} {h} in the model config {path}: each key/value head serves "
                f"the same number of query heads, so make {kv_heads} a divisor of {h}"
            )
    _check_positive_settings(config, path)
    if isinstance(config, SimpleNamespace):
        return  # a config class may default head_dim to other than hidden_size / heads: judged once built
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and getattr(config, "head_dim", None) is None and hidden % heads:
        raise ConfigError(
            f"num_attention_heads {heads} does not divide hidden_size {hidden} in the model config {path}: each head "
            f"takes hidden_size / num_attention_heads dimensions; make it a divisor of {hidden} (or set head_dim)"
        )


def _check_positive_settings(config: PretrainedConfig | SimpleNamespace, path: str) -> None:
    """rope_theta (also inside rope_parameters) must be positive, a norm's epsilon not negative: the model would train
    on NaN or without positions, silently."""
    rope = getattr(config, "rope_parameters", None)
    thetas = [getattr(config, "rope_theta", None), *(rope.get("rope_theta") for rope in _rope_dicts(rope))]
    for theta in thetas:
        if isinstance(theta, (int, float)) and not isinstance(theta, bool) and not theta > 0:  # NaN too
            raise ConfigError(f"rope_theta is {theta} in the model config {path}: the rotary base must be positive "
                              "(e.g. 10000 or 500000)")
    for name, value in vars(config).items():
        if (name.endswith(("_eps", "epsilon")) or name == "eps") and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and not value >= 0:
            raise ConfigError(f"{name} is {value} in the model config {path}: a norm's epsilon must be positive and "
                              "small (e.g. 1e-5 or 1e-6)")


def _rope_dicts(rope) -> list[dict]:
    """rope_parameters as a dict, or as a dict of dicts per attention kind (transformers 5)."""
    if not isinstance(rope, dict):
        return []
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return nested or [rope]


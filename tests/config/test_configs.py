"""The model-config zoo under configs/: every JSON loads, builds on the meta device, and is the size its name says.

Sized configs (``<type>_340M.json``, ``<type>_1B.json``, ...) must count within ±25% of the size in
their name; ``configs/tiny/`` must hold a debug config for every causal LM type fla registers.
``python -m tests.config.test_configs`` prints the tables of configs/README.md from the same counts.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

from flame.models import load_model_config
from tests.conftest import ROOT
from flame.models.registry import import_fla

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

CONFIG_DIR = ROOT / "configs"
CONFIGS = sorted(CONFIG_DIR.rglob("*.json"))
SIZE_IN_NAME = re.compile(r"_(\d+(?:\.\d+)?)([MB])\.json$")
UNITS = {"M": 10**6, "B": 10**9}
TOLERANCE = 0.25
# Sized configs at least this large train with the default tokenizer (a 32000-token llama one);
# smaller ones (llama_4M) and configs/tiny/ use the builtin 4096-token tokenizer.
DEFAULT_TOKENIZER_FROM = 100 * 10**6

def nominal_size(path: Path) -> int | None:
    """The parameter count in a file name such as ``gla_340M.json`` (None for unsized names)."""
    match = SIZE_IN_NAME.search(path.name)
    return None if match is None else round(float(match.group(1)) * UNITS[match.group(2)])


def build(path: Path):
    config = load_model_config(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return config, model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters: tied weights count once."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def fla_causal_lm_types() -> set[str]:
    import_fla()  # registers fla's types
    return {
        model_type
        for model_type in CONFIG_MAPPING
        if CONFIG_MAPPING[model_type].__module__.startswith("fla.")
        and CONFIG_MAPPING[model_type] in MODEL_FOR_CAUSAL_LM_MAPPING
    }


def test_configs_are_found():
    assert len(CONFIGS) > 40, CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_builds_at_its_size(path):
    config, model = build(path)
    vocab_size = config.vocab_size
    assert vocab_size % 64 == 0, f"{path.name}: vocab_size {vocab_size} is not a multiple of 64"
    assert model.get_output_embeddings().weight.shape[0] == vocab_size
    parameters = count_parameters(model)
    size = nominal_size(path)
    if size is None:
        assert path.parent.name == "tiny", f"{path.name}: name a config <type>_<size>.json or put it under tiny/"
        assert vocab_size >= 4096, f"{path.name}: vocab_size {vocab_size} < the builtin tokenizer's 4096 tokens"
        return
    if size >= DEFAULT_TOKENIZER_FROM:
        assert vocab_size >= 32000, f"{path.name}: vocab_size {vocab_size} < the default tokenizer's 32000 tokens"
    else:
        assert vocab_size >= 4096, f"{path.name}: vocab_size {vocab_size} < the builtin tokenizer's 4096 tokens"
    low, high = (1 - TOLERANCE) * size, (1 + TOLERANCE) * size
    assert low <= parameters <= high, f"{path.name}: {parameters / 1e6:.1f}M parameters, outside ±25% of its name"


def test_every_fla_causal_lm_type_has_a_tiny_config():
    types = fla_causal_lm_types()
    assert {"gla", "transformer", "rwkv7", "samba"} <= types
    tiny = {path.stem for path in (CONFIG_DIR / "tiny").glob("*.json")}
    missing = types - tiny
    assert not missing, f"no configs/tiny/<type>.json for {sorted(missing)}"
    for path in (CONFIG_DIR / "tiny").glob("*.json"):
        assert load_model_config(str(path)).model_type == path.stem, f"{path.name}: name it after its model_type"


def markdown_table(paths: list[Path]) -> str:
    rows = ["| file | model type | layers | hidden | parameters |", "| --- | --- | --- | --- | --- |"]
    for path in paths:
        config, model = build(path)
        name = path.relative_to(CONFIG_DIR)
        rows.append(
            f"| `{name}` | {config.model_type} | {config.num_hidden_layers} | {config.hidden_size} "
            f"| {count_parameters(model):,} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table([path for path in CONFIGS if path.parent == CONFIG_DIR]))
    print()
    print(markdown_table([path for path in CONFIGS if path.parent != CONFIG_DIR]))

"""In a fresh process, flame imports fla only when a model config needs it.

    python tests/scripts/fla_imported_on_demand.py MAMBA_MODEL_DIR   (cwd: the repository root)

Prints four lines, which test_models.py compares:
    "<transformers knows 'mamba'> <fla imported>"  after importing flame's trainer
    "<fla imported>"                               after loading an HF model's config (llama)
    the module of the config class of MAMBA_MODEL_DIR (a model directory of fla's mamba)
    the module of the config class of configs/gla_340M.json
"""

import sys

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

import flame.training.trainer  # noqa: F401  (what `python -m flame.train` imports first)
from flame.models import load_model_config

print("mamba" in CONFIG_MAPPING_NAMES, "fla" in sys.modules)
load_model_config("configs/llama_4M.json")
print("fla" in sys.modules)
print(type(load_model_config(sys.argv[1])).__module__)
print(type(load_model_config("configs/gla_340M.json")).__module__)

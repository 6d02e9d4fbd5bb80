"""User architectures: every package in this directory is imported, and so registered, by flame.

A package here registers its config and model classes with transformers' Auto classes on
import (``AutoConfig.register``, ``AutoModelForCausalLM.register``); a config JSON whose
``model_type`` names it then trains, converts and loads like any built-in model.
"""

import importlib
import pkgutil

for _package in pkgutil.iter_modules(__path__):
    if _package.ispkg:
        importlib.import_module(f"{__name__}.{_package.name}")

"""An example architecture to copy: a package under custom_models/ that registers itself.

Importing it (flame imports every package under custom_models/) maps the config's
``model_type`` to these classes, so a config JSON with ``"model_type": "flame_example_lm"``
trains with flame and its export loads with ``AutoModelForCausalLM`` after ``import custom_models``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import ExampleLMConfig
from .modeling import ExampleLMForCausalLM, ExampleLMModel

AutoConfig.register(ExampleLMConfig.model_type, ExampleLMConfig)
AutoModel.register(ExampleLMConfig, ExampleLMModel)
AutoModelForCausalLM.register(ExampleLMConfig, ExampleLMForCausalLM)

__all__ = ["ExampleLMConfig", "ExampleLMForCausalLM", "ExampleLMModel"]

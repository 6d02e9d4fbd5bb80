"""flame: train Hugging Face and flash-linear-attention causal LMs on torchtitan.

Load any model flame exported, in any Python process:

    import flame
    from transformers import AutoModelForCausalLM

    flame.register()
    model = AutoModelForCausalLM.from_pretrained("exp/run/hf")

Importing flame changes nothing and imports nothing heavy (flame's own processes import it
first); ``register`` does the work.
"""

__all__ = ["register"]


def register() -> None:
    """Make every model type flame trains load with transformers' Auto classes and run without flash-attn.

    Registers the architectures under custom_models/, imports fla (its types) with flame's
    changes, under which fla's softmax-attention layers (``transformer``, the hybrids, ...) run
    on PyTorch's own attention kernels instead of refusing to build without flash-attn. Models
    of transformers itself need nothing. Safe to call more than once; about as costly as
    ``import fla``. torchtitan is not imported.
    """
    from flame.models.registry import register_all

    register_all()

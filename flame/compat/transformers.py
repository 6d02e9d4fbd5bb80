"""transformers' seam: flame's attention in transformers' attention registry.

Written for transformers 5.17.0 (3rdparty/requirements.txt).
"""

from collections.abc import Callable

from transformers import AttentionInterface

from flame.compat.guard import Library, Target, patch

TRANSFORMERS = Library("transformers", "transformers", "5.17.0")


@patch(TRANSFORMERS, Target(TRANSFORMERS, "transformers", "AttentionInterface.register", ("key", "value")))
def attention_implementation(name: str, function: Callable) -> None:
    """Register ``function`` as the attention implementation ``name`` of every transformers model.

    Upstream: a model built with ``attn_implementation=name`` looks its attention function up in
    ``AttentionInterface``'s process-wide registry, which holds eager, sdpa, flash and flex.
    flame: adds its document-masked attention ("flame": flame.models.attention), which keeps
    packed documents apart using the ``cu_seq_lens_q`` flame passes with each batch. Applied when
    flame first resolves a model type (flame.models.registry.ensure_model_type), before any model
    is built.
    """
    AttentionInterface.register(name, function)

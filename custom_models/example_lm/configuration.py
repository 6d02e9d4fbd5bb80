"""The config of the example architecture: every size the model reads, saved as config.json."""

from transformers import PretrainedConfig


class ExampleLMConfig(PretrainedConfig):
    # The key that ties a config.json to these classes; it must not be a model_type that
    # transformers or fla already use.
    model_type = "flame_example_lm"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        intermediate_size: int = 1408,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size {hidden_size} must split into {num_attention_heads} heads of an even size (rotary)"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        # flame reads num_hidden_layers and num_attention_heads to count attention FLOPs (MFU).
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        # Passed on, not set here: the base class owns it. When true, transformers ties lm_head to
        # the input embedding (see _tied_weights_keys in modeling.py).
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

"""A small modern decoder in plain PyTorch: RMSNorm, rotary attention with document masking, SwiGLU.

What flame relies on, and where it is met:

- the decoder blocks live in one ``nn.ModuleList`` (``ExampleLMModel.layers``): flame shards,
  compiles and checkpoints the model block by block;
- ``_init_weights`` sets every parameter and non-persistent buffer: flame builds the model on
  the meta device, materializes it with ``to_empty`` (garbage values) and then runs the HF
  initialization, so anything left out here would start as garbage;
- ``forward(input_ids, position_ids=...)`` returns an output with ``.logits``; position ids
  restart at 0 at every document packed into a row, and attention must not cross them.

Attention goes through transformers' attention registry: flame builds models with its own
``flame`` implementation (document-masked varlen kernels on GPU, given ``cu_seq_lens_q``);
``sdpa``/``eager`` (e.g. a plain ``from_pretrained``) use a dense document mask built here.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
)

from .configuration import ExampleLMConfig


class ExampleLMRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 even when training in bfloat16: the mean of squares loses precision.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class ExampleLMRotaryEmbedding(nn.Module):
    """cos/sin of each token's position; positions are the (per-document) position ids."""

    def __init__(self, config: ExampleLMConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = config.rope_theta
        # Non-persistent: derived from the config, so not saved; _init_weights recomputes it.
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 angles: bfloat16 cannot tell position 1000 from 1004.
        angles = position_ids[..., None].float() * self.inv_freq.float()  # (batch, seq, head_dim / 2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # (batch, 1, seq, head_dim), broadcast over heads
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean mask, True where a query may attend to a key.

    A document starts wherever the position id is 0, so numbering the starts seen so far
    gives each token its document; a token attends to earlier tokens of its own document.
    (A dense mask is simple and exact; at long context, flex attention or a varlen kernel
    with the same document boundaries avoids materializing seq x seq.)
    """
    document = (position_ids == 0).cumsum(dim=-1)
    same_document = document[:, :, None] == document[:, None, :]
    seq_len = position_ids.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=position_ids.device).tril()
    return (same_document & causal)[:, None]


class ExampleLMAttention(nn.Module):
    is_causal = True  # read by transformers' attention functions

    def __init__(self, config: ExampleLMConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask: torch.Tensor | None, **attention_kwargs) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # qkv_proj's output is laid out head by head (q, k, v of head 0, then of head 1, ...), so a
        # tensor-parallel shard of its rows holds whole heads (flame/distributed/tensor_parallel.py)
        qkv = self.qkv_proj(x).view(batch, seq_len, self.num_heads, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (batch, heads, seq, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if mask is not None:  # sdpa/eager: the dense document mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        else:  # a registered attention function, e.g. flame's (documents from cu_seq_lens_q)
            attention = AttentionInterface()[self.config._attn_implementation]
            out, _ = attention(self, q, k, v, None, **attention_kwargs)  # (batch, seq, heads, head_dim)
        return self.o_proj(out.reshape(batch, seq_len, -1))


class ExampleLMMLP(nn.Module):
    """SwiGLU: silu(x W_gate) * (x W_up), projected back down."""

    def __init__(self, config: ExampleLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExampleLMBlock(nn.Module):
    """Pre-norm residual block; the unit flame shards (FSDP), compiles and recomputes (AC)."""

    def __init__(self, config: ExampleLMConfig):
        super().__init__()
        self.attn_norm = ExampleLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = ExampleLMAttention(config)
        self.mlp_norm = ExampleLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ExampleLMMLP(config)

    def forward(self, x, cos, sin, mask: torch.Tensor | None, **attention_kwargs) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, **attention_kwargs)
        return x + self.mlp(self.mlp_norm(x))


class ExampleLMPreTrainedModel(PreTrainedModel):
    config_class = ExampleLMConfig
    base_model_prefix = "model"  # the attribute of ExampleLMForCausalLM that holds ExampleLMModel
    _no_split_modules: ClassVar[list[str]] = ["ExampleLMBlock"]  # device_map="auto" keeps a block on one device
    _supports_attention_backend = True  # any function of transformers' attention registry (flame's too)
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        # transformers.initialization functions skip tensors that from_pretrained already loaded.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ExampleLMRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ExampleLMRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())


class ExampleLMModel(ExampleLMPreTrainedModel):
    def __init__(self, config: ExampleLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = ExampleLMRotaryEmbedding(config)
        self.layers = nn.ModuleList(ExampleLMBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = ExampleLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,  # flame's document boundaries, for its attention
        **kwargs,  # e.g. generate's use_cache (this example keeps no KV cache)
    ) -> BaseModelOutputWithPast:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            if attention_mask is not None:
                # Only used to derive positions, for a left-padded batch in generate: real tokens
                # count from 0, so the padding forms a document that no real token attends to.
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
                position_ids = position_ids.masked_fill(attention_mask == 0, 1)
            else:
                position_ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        cos, sin = self.rotary(position_ids, x.dtype)
        if self.config._attn_implementation in ("sdpa", "eager"):
            mask, attention_kwargs = document_causal_mask(position_ids), {}
        else:
            mask, attention_kwargs = None, {"cu_seq_lens_q": cu_seq_lens_q}
        for block in self.layers:
            x = block(x, cos, sin, mask, **attention_kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x))


class ExampleLMForCausalLM(ExampleLMPreTrainedModel, GenerationMixin):
    # With tie_word_embeddings, lm_head.weight is the embedding matrix (saved once).
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ExampleLMConfig):
        super().__init__(config)
        self.model = ExampleLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # get/set_input_embeddings: PreTrainedModel finds them on self.model (base_model_prefix)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids, position_ids, attention_mask, inputs_embeds, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # HF convention (flame computes its own loss from the logits)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs) -> dict:
        # No KV cache: every generated token re-runs the whole sequence. Quadratic, but short and
        # obviously correct; plenty for sampling from an export.
        return {"input_ids": input_ids, "attention_mask": attention_mask}

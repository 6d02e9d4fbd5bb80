"""fla's Mamba and Mamba2 layers computed by flame's kernels: fast, and packed documents kept apart.

Written for fla-core 0.6.0 and mamba-ssm 2.3.2.post1. fla's ``Mamba`` (mamba, samba) trains with
mamba_ssm's and causal_conv1d's CUDA kernels where they are installed and with a token-by-token
PyTorch scan where not; its ``Mamba2`` through mamba_ssm's fused kernel or a PyTorch reference that
runs out of memory at 340M. None of them takes ``cu_seqlens``, so packed documents shared their
state. The computations that replace them are flame's (flame.models.kernels.mamba, .mamba2), handed
in by flame.models.registry.import_fla through flame.compat.apply_after_fla_import.
"""

import importlib
import logging
from collections.abc import Callable

from flame.compat.fla import FLA
from flame.compat.guard import Target, patch

_MAMBA = Target(FLA, "fla.layers.mamba", "Mamba.forward",
                ("self", "hidden_states", "attention_mask", "past_key_values", "use_cache", "output_attentions"))
_CONV = Target(FLA, "fla.modules.causal_conv1d", "causal_conv1d",
               ("x", "weight", "bias", "residual", "initial_state", "output_final_state", "activation", "backend",
                "cu_seqlens"))


@patch(FLA, _MAMBA, _CONV)
def mamba_scans_documents(mamba_mix: Callable) -> None:
    """Give fla's Mamba layer (mamba, samba) flame's selective scan in training and prefill.

    Upstream: without mamba_ssm's and causal_conv1d's CUDA builds (they compile with nvcc; no GPU
    image here has them) the layer scans token by token in PyTorch, far too slow to train;
    with them or without, it ignores ``cu_seqlens``, so a packed document starts from the state
    the previous one left (docs/models-verified.md).
    flame: a forward without a cache (training, validation, scoring) runs ``mamba_mix``: fla's
    causal_conv1d Triton kernel, which restarts at every document, and flame's selective scan
    (flame.models.kernels.selective_scan: Triton kernels on GPUs, a PyTorch loop on CPUs), whose state
    restarts at every document. Same parameters, same math. Decoding with a cache (``generate``)
    keeps fla's path, which takes one sequence per row: given packed documents there, it refuses.
    """
    layer = importlib.import_module(_MAMBA.module)
    original = layer.Mamba.forward

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, **kwargs):
        if use_cache or past_key_values is not None or hidden_states.shape[1] == 0:
            if cu_seqlens is not None and cu_seqlens.numel() > 2:
                raise ValueError("fla's Mamba layer decodes with a cache one sequence per row, not packed documents "
                                 "(cu_seqlens): pass one sequence per row")
            return original(self, hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                            **kwargs)
        return mamba_mix(self, hidden_states, cu_seqlens, attention_mask), None, past_key_values

    forward.scans_documents = True
    layer.Mamba.forward = forward


FLA_MAMBA2 = "fla.layers.mamba2"


@patch(
    FLA,
    Target(FLA, FLA_MAMBA2, "Mamba2.forward", ("self", "hidden_states", "attention_mask", "past_key_values", "use_cache")),
    Target(FLA, FLA_MAMBA2, "get_layer_cache", ("module", "past_key_values")),
    Target(FLA, FLA_MAMBA2, "update_layer_cache", ("module", "past_key_values")),
    Target(FLA, "fla.modules.causal_conv1d", "causal_conv1d", ("x", "weight", "bias")),
    Target(FLA, "fla.ops.simple_gla", "chunk_simple_gla", ("q", "k", "v", "g", "g_gamma", "scale")),
    Target(FLA, "fla.ops.gla", "chunk_gla", ("q", "k", "v", "g", "scale")),
)
def mamba2_keeps_documents_apart(forward_keeping_documents_apart: Callable) -> None:
    """Train fla's Mamba2 layers on fla's Triton kernels, each packed document on its own (module docstring).

    fla warns, once per layer it builds (48 lines per rank at 340M), that it does not recommend
    its Triton conv backend: flame chose that conv and checks it against fla's PyTorch path
    (tests/models/test_mamba2_kernels.py, tests/gpu/test_mamba2_gpu.py), so that warning is dropped.
    """
    layer = importlib.import_module(FLA_MAMBA2)
    layer.Mamba2.forward = forward_keeping_documents_apart(layer.Mamba2.forward)
    logging.getLogger(FLA_MAMBA2).addFilter(
        lambda record: not record.getMessage().startswith("Mamba2 does not recommend using Triton's conv1d backend"))

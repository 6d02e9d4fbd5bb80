"""transformers' hybrid models: packed documents kept apart in their recurrent and convolutional layers.

transformers' hybrids (qwen3_5, qwen3_next, olmo_hybrid, kimi_linear, nemotron_h, falcon_h1, granitemoehybrid,
bamba, jamba, lfm2) put layers that carry state along the sequence (gated delta rules, Mamba scans, short causal
convolutions) beside softmax attention. flame's attention keeps packed documents apart
(flame.models.kernels.attention); these layers take no document boundaries, so each document of a row would start
from the state the previous one left. ``keep_documents_apart`` gives each such layer of a model flame builds (the
classes in ``MIXERS``) a forward that, inside a batch with documents (flame.base.batch_context), keeps them apart
in one of two ways:

- over the batch flattened into one row, with its modeling module's kernels replaced by ones that restart at
  every document (flame.models.kernels.varlen: fla's varlen kernels, mamba_ssm's SSD scan, flame's selective
  scan): one call per layer, on GPUs;
- once per document: the batch split at its documents, the layer run on each from zero state, the outputs
  concatenated. Exact on any device and as slow as the documents are many: the CPU's path, where the kernels
  run as their modeling module's PyTorch code (flame.compat.transformers.reference_kernels_on_cpu).

Outside a batch (``generate``, scoring an export) the layers run as upstream. They run outside compiled graphs
(a graph break per layer), as flame's attention does: the compiler would otherwise recompile for every new
set of document lengths.
"""

import collections
import functools
from collections.abc import Callable

import torch
from torch import nn

from flame import compat
from flame.base import batch_context
from flame.models.kernels import varlen

_GATED_DELTA_NET = {"causal_conv1d_fn": varlen.causal_conv,
                    "torch_chunk_gated_delta_rule": varlen.delta_rule(varlen.GATED_DELTA_RULE)}
_MAMBA2 = {"causal_conv1d_fn": varlen.causal_conv, "mamba2_split_conv1d_scan_combined": varlen.unfused,
           "mamba2_chunk_scan": varlen.mamba2_scan}

# each transformers layer that carries state along the sequence -> the kernels (functions of its modeling module)
# its forward calls without a cache, each with the factory of flame's kernel that restarts at every document
MIXERS: dict[str, dict[str, Callable[[Callable], Callable]]] = {
    "Qwen3_5GatedDeltaNet": _GATED_DELTA_NET,
    "Qwen3NextGatedDeltaNet": _GATED_DELTA_NET,
    "OlmoHybridGatedDeltaNet": _GATED_DELTA_NET,
    "KimiLinearDeltaAttention": {"causal_conv1d_fn": varlen.causal_conv,
                                 "chunk_kimi_delta_attention": varlen.delta_rule(varlen.KIMI_DELTA_RULE)},
    "NemotronHMamba2Mixer": _MAMBA2,
    "FalconH1Mixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "JambaMambaMixer": {"causal_conv1d_fn": varlen.causal_conv, "mamba_selective_scan": varlen.selective_scan},
    "Lfm2ShortConv": {"causal_conv1d_fn": varlen.causal_conv},
}
# the keyword flame's attention takes the documents by (flame.models.inputs), which reaches these layers too: their
# kernels would take it for the documents of the flattened row or of one piece; they read the batch's instead
_ATTENTION_DOCUMENTS = "cu_seq_lens_q"


class KeepsDocumentsApart:
    """Mixin of a layer in ``MIXERS``: its forward keeps the documents of the batch being computed apart."""

    over_flattened_batch = False  # one call over the flattened batch (flame's varlen kernels), else one per document

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = super().forward
        batch = batch_context.current()
        if batch is None or batch.cu_seqlens is None:
            return layer(hidden_states, *args, **kwargs)
        kwargs.pop(_ATTENTION_DOCUMENTS, None)
        row = hidden_states.reshape(1, -1, hidden_states.shape[-1])  # no document crosses rows
        if self.over_flattened_batch:
            out = layer(row, *args, **kwargs)
        else:
            lengths = batch.cu_seqlens.diff().tolist()
            # each piece is one whole document: the kernels find no documents inside it to restart at
            with batch_context.computing(batch.replace(cu_seqlens=None, max_seqlen=None)):
                out = torch.cat([layer(piece, *args, **kwargs) for piece in row.split(lengths, dim=1)], dim=1)
        return out.reshape(*hidden_states.shape[:-1], out.shape[-1])


@functools.cache
def _keeping_documents_apart(layer: type, over_flattened_batch: bool) -> type:
    # same name and module as the layer's class: exports and checkpoints see transformers' model
    attributes = {"__module__": layer.__module__, "over_flattened_batch": over_flattened_batch}
    return type(layer.__name__, (KeepsDocumentsApart, layer), attributes)


def keep_documents_apart(model: nn.Module, kernels: bool) -> str | None:
    """Make the layers of ``model`` in ``MIXERS`` keep the documents of a packed batch apart; the line saying so
    for the log, or None where the model has none.

    ``kernels``: each layer runs over the flattened batch on flame's varlen kernels (GPUs), else once per document.
    """
    layers = [module for module in model.modules() if type(module).__name__ in MIXERS]
    if not layers:
        return None
    if kernels:
        varlen.check()
    for layer_class in {type(layer) for layer in layers}:
        replacements = MIXERS[layer_class.__name__]
        compat.transformers.reference_kernels_on_cpu(layer_class.__module__, tuple(replacements))()
        if kernels:
            compat.transformers.kernels_take_documents(layer_class.__module__, tuple(replacements))(replacements)
    for layer in layers:
        layer.__class__ = _keeping_documents_apart(type(layer), kernels)
    counts = collections.Counter(type(layer).__name__ for layer in layers)
    how = ("over the batch flattened into one row, on kernels that restart at each document "
           "(flame.models.kernels.varlen)" if kernels else "once per document (no varlen kernels on this device)")
    named = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    return f"Packed documents kept apart in {named}: {how}"

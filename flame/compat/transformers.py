"""transformers' seam: flame's attention in transformers' attention registry, fused rotary embeddings,
scikit-learn imported only where assisted generation uses it,
hybrid models' sequence kernels: their PyTorch references on CPU tensors, flame's varlen kernels in packed batches.

Written for transformers 5.17.0 (3rdparty/requirements.txt).
"""

import functools
import importlib
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface

from flame.compat.guard import Library, Patch, Target, patch

TRANSFORMERS = Library("transformers", "transformers", "5.17.0")
ROTARY = "apply_rotary_pos_emb"  # the modeling modules' function that rotates queries and keys


@patch(TRANSFORMERS, Target(TRANSFORMERS, "transformers", "AttentionInterface.register", ("key", "value")))
def attention_implementation(name: str, function: Callable) -> None:
    """Register ``function`` as the attention implementation ``name`` of every transformers model.

    Upstream: a model built with ``attn_implementation=name`` looks its attention function up in
    ``AttentionInterface``'s process-wide registry, which holds eager, sdpa, flash and flex.
    flame: adds its document-masked attention ("flame": flame.models.kernels.attention), which keeps
    packed documents apart using the ``cu_seq_lens_q`` flame passes with each batch. Applied when
    flame first resolves a model type (flame.models.registry.ensure_model_type), before any model
    is built.
    """
    AttentionInterface.register(name, function)


def rotary_target(module_name: str) -> Target:
    """The rotary function of a modeling module, as flame's fused rotary replaces it."""
    return Target(TRANSFORMERS, module_name, ROTARY, ("q", "k", "cos", "sin"))


def _fused_rotary(module_name: str, fuse: Callable[[Callable], Callable]) -> None:
    """Make the attention of ``module_name`` rotate its queries and keys with ``fuse(its apply_rotary_pos_emb)``.

    Upstream: a decoder's attention calls its modeling module's ``apply_rotary_pos_emb(q, k, cos,
    sin)``, which rotates q and k through ``rotate_half`` (two slices, a negation, a concatenation,
    two products and a sum: about six kernels per tensor each way in eager code). The attention
    looks the function up in its module at every call, so it can only be replaced there, for
    every model of that module in the process. flame: the replacement (flame.models.kernels.fused) runs
    the same rotation in one fla kernel per tensor on CUDA, and calls the original everywhere
    else (CPU, inside compiled graphs, arguments it does not take). Applied once per modeling
    module by flame.models.kernels.fused.use_fused_kernels, only where the module's function computes the
    rotation fla's kernel computes (checked on a probe first).
    """
    module = importlib.import_module(module_name)
    setattr(module, ROTARY, fuse(getattr(module, ROTARY)))


@functools.cache
def fused_rotary(module_name: str) -> Patch:
    """The change putting a fused rotary function in ``module_name`` (one per module, each applied once)."""
    change = functools.partial(_fused_rotary, module_name)
    change.__name__ = f"fused_rotary({module_name.rpartition('.')[2].removeprefix('modeling_')})"
    change.__doc__ = _fused_rotary.__doc__
    return Patch(TRANSFORMERS, change, (rotary_target(module_name),))


CANDIDATE_GENERATOR = "transformers.generation.candidate_generator"


@patch(TRANSFORMERS, Target(TRANSFORMERS, "transformers.utils", "is_sklearn_available", ()))
def scikit_learn_imported_when_used() -> None:
    """Import scikit-learn when assisted generation first needs it, not with every model class.

    Upstream: every model class imports ``transformers.generation``, whose candidate generator
    imports ``sklearn.metrics.roc_curve`` at import time wherever scikit-learn is installed
    (lm-eval needs it, so flame's environment has it): 1-2 s of CPU (scikit-learn and the scipy
    it loads) in each process, every rank of every run, for a function only assisted
    generation with a dynamic confidence threshold calls. flame: imports the candidate
    generator with scikit-learn reported missing, then gives it back the real availability
    check and a ``roc_curve`` that imports scikit-learn's on first call, so generation behaves
    as upstream. Applied first thing in train.sh's preflight, each rank and the HF export
    (flame.launch.preflight, flame.train, flame.launch.supervise, flame.checkpoint.export); where the
    module was imported already, there is nothing left to defer.
    """
    if CANDIDATE_GENERATOR in sys.modules:
        return
    utils = importlib.import_module("transformers.utils")
    available = utils.is_sklearn_available
    utils.is_sklearn_available = lambda: False
    try:
        module = importlib.import_module(CANDIDATE_GENERATOR)
    finally:
        utils.is_sklearn_available = available
    module.is_sklearn_available = available

    def roc_curve(*args, **kwargs):
        from sklearn.metrics import roc_curve

        return roc_curve(*args, **kwargs)

    module.roc_curve = roc_curve


def _module_kernels(module_name: str, names: tuple[str, ...], change: Callable, label: str) -> Patch:
    """The change of ``module_name``'s kernel functions ``names`` (one per module, each applied once)."""
    targets = tuple(Target(TRANSFORMERS, module_name, name, holds=lambda kernel: hasattr(kernel, "__wrapped__"),
                           shape="a kernel picked by use_kernel_func_from_hub_with_fallback") for name in names)
    applied = functools.partial(change, module_name, names)
    applied.__name__ = f"{label}({module_name.rpartition('.')[2].removeprefix('modeling_')})"
    applied.__doc__ = change.__doc__
    return Patch(TRANSFORMERS, applied, targets)


def _reference_kernels_on_cpu(module_name: str, names: tuple[str, ...]) -> None:
    """Run a hybrid model's sequence kernels on CPU tensors as the PyTorch code of its modeling module.

    Upstream: a hybrid's modeling module (qwen3_5, bamba, ...) defines its gated delta rule, causal
    conv and Mamba scans in PyTorch and decorates each with ``use_kernel_func_from_hub_with_fallback``,
    which at import picks another package's kernel wherever that package imports: fla's Triton
    kernels wherever fla is installed, GPU or not. The PyTorch code stays only as the wrapper's
    ``__wrapped__``, and on a CPU the Triton kernel fails ("0 active drivers").
    flame: each named kernel runs its PyTorch code on CPU tensors, and the picked kernel on any
    other device. Applied when flame builds a model of the module (flame.models.hybrid).
    """
    module = importlib.import_module(module_name)
    for name in names:
        picked = getattr(module, name)
        setattr(module, name, _by_device(picked, picked.__wrapped__))


def _by_device(picked: Callable, reference: Callable) -> Callable:
    @functools.wraps(picked)
    def kernel(*args, **kwargs):
        tensor = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
        return (reference if tensor.device.type == "cpu" else picked)(*args, **kwargs)

    return kernel


@functools.cache
def reference_kernels_on_cpu(module_name: str, names: tuple[str, ...]) -> Patch:
    """The change running ``names`` of ``module_name`` as PyTorch code on CPU tensors (``_reference_kernels_on_cpu``)."""
    return _module_kernels(module_name, names, _reference_kernels_on_cpu, "reference_kernels_on_cpu")


def _kernels_take_documents(module_name: str, names: tuple[str, ...],
                            replacements: dict[str, Callable[[Callable], Callable]]) -> None:
    """Give a hybrid model's sequence kernels the documents of a packed batch.

    Upstream: the layers of a hybrid that carry state along the sequence (gated delta rules, Mamba
    scans, short convolutions) call their modeling module's kernels with no document boundaries:
    each document of a packed row starts from the state the previous one left. (The gated delta
    rule gets the attention's ``cu_seq_lens_q`` keyword, which describes the rows of a batch the
    kernel takes only as one row; its conv gets nothing.)
    flame: each named kernel becomes ``replacements[name](the kernel)`` (flame.models.kernels.varlen):
    inside a batch with documents (flame.base.batch_context) it passes them to a kernel that restarts
    at each (fla's varlen kernels, mamba_ssm's SSD scan, flame's selective scan); elsewhere it calls
    the kernel it replaced. Applied on GPUs when
    flame builds a model of the module (flame.models.hybrid), whose layers then run over the batch
    flattened into one row.
    """
    module = importlib.import_module(module_name)
    for name in names:
        setattr(module, name, replacements[name](getattr(module, name)))


@functools.cache
def kernels_take_documents(module_name: str, names: tuple[str, ...]) -> Patch:
    """The change giving ``names`` of ``module_name`` the batch's documents (``_kernels_take_documents``)."""
    return _module_kernels(module_name, names, _kernels_take_documents, "kernels_take_documents")

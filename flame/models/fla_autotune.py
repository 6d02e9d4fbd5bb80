"""Autotuning keys of fla kernels that would tune again for every document length.

Triton benchmarks every config of an autotuned kernel once per value of its key arguments.
fla 0.6's deltaformer keys its kernels on the length of the chunk (``C``) or document (``T``)
they run on, and its varlen path calls them document by document: under packed documents each
new length benchmarks 8-16 configs again, and the tiny deltaformer did not finish 12 training
steps within 470 s on an H200 (docs/models.md). Without the length in the key a kernel is
tuned at the first length it sees and keeps that choice; the lengths are masked inside the
kernels, so every config computes the same result.
"""

import importlib

# module -> the length arguments to drop from its autotuned kernels' keys
_KEYED_ON_LENGTH = {"fla.ops.deltaformer.parallel": ("C", "T")}


def tune_once_per_shape() -> None:
    """Drop the length arguments from those kernels' autotune keys."""
    from triton.runtime.autotuner import Autotuner

    for module_name, lengths in _KEYED_ON_LENGTH.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:  # another fla version (a 3rdparty/ checkout) may have moved or fixed it
            continue
        for kernel in vars(module).values():
            if isinstance(kernel, Autotuner) and any(key in lengths for key in kernel.keys):
                kernel.keys = [key for key in kernel.keys if key not in lengths]

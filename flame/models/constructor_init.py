"""What a model's constructor initializes and its HF init does not: found, and given the constructor's values.

flame builds every model on the meta device and then runs the model's own HF initialization (``init_weights``) on
its materialized tensors (flame.models.builder.reinitialize). That reproduces the model transformers would build
only where ``_init_weights`` covers every tensor. Many of fla's layers set some of theirs in their constructors
alone: rwkv7's token-shift mixes, decay biases and orthogonal projections (and it marks those modules initialized,
so that HF's init leaves them alone), the A_log and D of samba's and raven's state-space layers, hgrn's lower
bounds, and more (14 of fla's types, tests/models/test_constructor_init.py). On the meta device a constructor
computes nothing, so those tensors would hold whatever memory ``to_empty`` handed them.

``repeat_constructor_init`` finds them by filling every floating tensor with NaN before HF's init and reading which
it left so, and gives them the constructor's values by running the constructor again, where the values are
computed, one unit at a time: each decoder block holding such a tensor is built anew on the model's device (fla's
blocks take ``(config, layer_idx)``) and those tensors copied from it, with every tensor of the modules its
constructor marked initialized; a tensor outside the blocks (hgrn's lower bounds) comes from the module holding it,
built anew with its decoder blocks left out. The random draws come from the job's generator, after HF's init, so
the result is reproducible from the seed under every layout. A tensor still not initialized after that stops the
run, named: training from leftover memory would not.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from flame.base.errors import ConfigError
from flame.models.registry import decoder_layers

_HF_INITIALIZED = "_is_hf_initialized"  # transformers' flag: its init_weights skips a module carrying it


def poison(model: nn.Module) -> None:
    """Fill every floating-point parameter and buffer with NaN: what no init writes stays NaN."""
    with torch.no_grad():
        for tensor in _floating(model):
            tensor.fill_(float("nan"))


def repeat_constructor_init(model: nn.Module) -> None:
    """After ``poison`` and HF's init: give the tensors HF's init left NaN their constructor's values (module doc)."""
    missing = _left_nan(model)
    if not missing:
        return
    blocks = decoder_layers(model)
    block_prefix = {id(block): name for name, block in model.named_modules() if _is_block(block, blocks)}
    by_block: dict[int, list[str]] = {}
    by_owner: dict[str, list[str]] = {}  # outside the blocks: by the module holding them
    for name in missing:
        if (index := _block_index(name, blocks, block_prefix)) is not None:
            by_block.setdefault(index, []).append(name)
        else:
            by_owner.setdefault(name.rpartition(".")[0], []).append(name.rpartition(".")[2])
    with torch.no_grad():
        for index, names in by_block.items():
            _from_fresh_block(model, blocks, index, block_prefix[id(blocks[index])], names)
        for owner, names in by_owner.items():
            _from_fresh_owner(model.get_submodule(owner), type(blocks[0]), names)
    if left := _left_nan(model):
        raise ConfigError(
            f"{model.config.model_type}: {len(left)} tensors ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}) "
            "are initialized by the model's constructor alone, and flame could not build it again to read them "
            "(training would start from leftover memory there): give the model an _init_weights that sets them "
            "(docs/models.md, Add your own model), or report the model type")


def _floating(model: nn.Module):
    tensors = [*model.parameters(), *model.buffers()]
    return [tensor for tensor in tensors if tensor is not None and tensor.is_floating_point()]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _left_nan(model: nn.Module) -> list[str]:
    """Names of the tensors holding NaN (under FSDP, in this rank's shard: every rank's init leaves the same ones)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, tensor in named
            if tensor is not None and tensor.is_floating_point() and bool(_local(tensor).isnan().any())]


def _assign(target: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` (whole) into ``target``, or into this rank's shard of it: each rank built the same whole tensor, so
    each takes its own part, with no collective."""
    if isinstance(target, DTensor):
        values = distribute_tensor(values.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    _local(target).copy_(_local(values))


def _is_block(module: nn.Module, blocks: nn.ModuleList) -> bool:
    return any(module is block for block in blocks)


def _block_index(name: str, blocks: nn.ModuleList, prefixes: dict[int, str]) -> int | None:
    for index, block in enumerate(blocks):
        if name.startswith(prefixes[id(block)] + "."):
            return index
    return None


def _device_of(module: nn.Module) -> torch.device:
    return _local(_floating(module)[0]).device


def _from_fresh_block(model: nn.Module, blocks: nn.ModuleList, index: int, prefix: str, names: list[str]) -> None:
    block = blocks[index]
    with torch.device(_device_of(block)):
        fresh = type(block)(model.config, layer_idx=index)
    own = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    built = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
    # every tensor of a module its constructor marked initialized: HF's init, which skips such a module in a model
    # transformers builds, gave flame's its own values instead
    marked = {f"{module_name}.{tensor_name}".lstrip(".")
              for module_name, module in fresh.named_modules() if getattr(module, _HF_INITIALIZED, False)
              for tensor_name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]}
    wanted = {name[len(prefix) + 1:] for name in names} | {name for name in own if _unadapted(name) in marked}
    for relative in wanted:
        if (source := built.get(_unadapted(relative))) is not None:
            _assign(own[relative], source)


def _unadapted(name: str) -> str:
    """A LoRA-adapted layer's base weight under the name the plain block gives it."""
    return name.replace(".base_layer.", ".")


def _from_fresh_owner(owner: nn.Module, block_class: type, names: list[str]) -> None:
    """Tensors outside the blocks: from their module built anew (one built from a ``config``) with its decoder blocks
    left out (they would be built for real: the whole model's weights)."""
    config = getattr(owner, "config", None)
    if config is None:
        return  # left NaN: repeat_constructor_init names them
    with _blocks_left_out(type(owner), block_class), torch.device(_device_of(owner)):
        fresh = type(owner)(config)
    source = {**dict(fresh.named_parameters(recurse=False)), **dict(fresh.named_buffers(recurse=False))}
    target = {**dict(owner.named_parameters(recurse=False)), **dict(owner.named_buffers(recurse=False))}
    for name in names:
        if name in source:
            _assign(target[name], source[name])


@contextmanager
def _blocks_left_out(owner_class: type, block_class: type):
    """While inside, the owner's module builds an empty module wherever it builds a decoder block."""
    module = sys.modules[owner_class.__module__]
    names = [name for name, value in vars(module).items() if value is block_class]
    for name in names:
        setattr(module, name, lambda *args, **kwargs: nn.Identity())
    try:
        yield
    finally:
        for name in names:
            setattr(module, name, block_class)

"""fla's Triton conv and scan under Triton's interpreter (CPU): flame's Mamba2 kernel path = its PyTorch path.

    TRITON_INTERPRET=1 python tests/scripts/mamba2_interpreted.py

One tiny Mamba2 layer (float32, PyTorch norms) over a packed row of documents: output, every
gradient and the per-document cache states of ``flame.models.kernels.mamba2.prefill`` with
``kernels=True`` (fla's ``causal_conv1d`` with fla's ``chunk_simple_gla`` or ``chunk_gla``, or with
mamba_ssm's SSD scan; interpreted) against ``kernels=False``. Prints ``kernels = pytorch`` when they agree, else raises.

Two gaps in Triton 3.6's interpreter are bridged here, for this process only: it turns a
1-element array into an index with ``int()``, which NumPy 2.4 refuses; and a ``for`` loop's
variable is a Python int, on which fla's kernels call ``.to()``; and mamba_ssm asks the
CUDA device for its multiprocessors and selects it around its launches. Autotuning runs the first
config once (the interpreter has no timer; every config computes the same result).
"""

import ast
import contextlib
import os
import types

import torch
from triton.runtime import interpreter
from triton.runtime.autotuner import Autotuner

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


def _patch_tensor(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def _loop_variable_as_tensor(self, node):
    self.generic_visit(node)
    if isinstance(node.target, ast.Name):  # first statement of the body: i = interpreter_semantic.to_tensor(i, False)
        to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                  ctx=ast.Load())
        node.body.insert(0, ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())], value=ast.Call(
            func=to_tensor, args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)], keywords=[])))
    return node


_patch_lang_tensor = interpreter._patch_lang_tensor
interpreter._patch_lang_tensor = _patch_tensor
interpreter.ASTTransformer.visit_For = _loop_variable_as_tensor
_prune = Autotuner.prune_configs
Autotuner.prune_configs = lambda self, kwargs: _prune(self, kwargs)[:1]
Autotuner.do_bench = property(lambda self: lambda call, quantiles: (call(), [0.0, 0.0, 0.0])[1])
# mamba_ssm selects the tensors' GPU around its launches and splits heads over the GPU's multiprocessors
torch.cuda.device = lambda index: contextlib.nullcontext()
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=2)

from flame.base import batch_context
from flame.base.batch_context import BatchContext
from flame.compat import fla as fla_compat, mamba_ssm
from flame.models.kernels import mamba2
from flame.models import registry
from tests.scripts.torch_kernels import _rms_norm_gated


def main() -> None:
    registry.import_fla()
    from fla.layers.mamba2 import Mamba2

    torch.manual_seed(0)
    layer = Mamba2(num_heads=4, head_dim=8, hidden_size=16, state_size=8, expand=2, n_groups=1, chunk_size=16,
                   layer_idx=0)
    layer.norm.forward = types.MethodType(_rms_norm_gated, layer.norm)
    layer.act = torch.nn.functional.silu
    lengths = [9, 2, 30, 7]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    hidden = torch.randn(1, sum(lengths), 16, requires_grad=True)
    weights = torch.randn(1, sum(lengths), 16)
    # (name, kernels, per_key_decay, use_cache): fla's simple-GLA kernel, fla's GLA kernel (where fla
    # refuses simple GLA's backward), both without cache states as in training (mamba_ssm's SSD
    # kernel; fla's GLA kernel, its mixer recomputed in the backward), mamba_ssm's SSD kernel giving
    # the cache's per-document states (a prompt before generation: no backward), PyTorch
    paths = (("chunk_simple_gla", True, False, True), ("chunk_gla", True, True, True),
             ("chunk_gla, chunk totals from the host", True, True, True),
             ("mamba_ssm SSD", True, False, False), ("chunk_gla recomputed", True, True, False),
             ("mamba_ssm SSD, states", True, False, True), ("pytorch", False, False, True))
    results, ssd_scan = {}, mamba_ssm.ssd_scan
    host_totals = []  # the chunk totals fla's chunk_h read from the host's cu_seqlens (flame.compat.fla.ChunkOffsets)
    take_total = fla_compat.ChunkOffsets.__getitem__

    def counted(self, index):
        value = take_total(self, index)
        if index == -1:
            host_totals.append(int(value))
        return value

    fla_compat.ChunkOffsets.__getitem__ = counted
    assert ssd_scan() is not None, "mamba_ssm is not installed (3rdparty/install.sh installs it)"
    for name, kernels, per_key_decay, use_cache in paths:
        mamba2.gated_chunk_backward_refused = lambda refused=per_key_decay: refused
        mamba2.mamba_ssm.ssd_scan = ssd_scan if name.startswith("mamba_ssm SSD") else lambda: None
        backward = name != "mamba_ssm SSD, states"
        layer.zero_grad()
        hidden.grad = None
        batch = BatchContext(cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens.tolist()) if "host" in name else None
        with torch.set_grad_enabled(backward), batch_context.computing(batch) if batch else contextlib.nullcontext():
            out, conv_state, ssm_state = mamba2.prefill(layer, hidden, cu_seqlens=cu_seqlens, use_cache=use_cache,
                                                            kernels=kernels)
        states = {"conv_state": conv_state, "ssm_state": ssm_state} if use_cache else {}
        results[name] = {"output": out.detach(), **states}
        if backward:
            with batch_context.computing(batch) if batch else contextlib.nullcontext():
                (out * weights).sum().backward()
            results[name] |= {"input grad": hidden.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    # chunk_gla's forward sizes its states by the chunk total, its backward twice (the states again, their gradients);
    # only inside the batch that holds the host's copy, and the same count fla reads from the GPU
    chunks = sum(-(-length // 64) for length in lengths)
    assert host_totals == [chunks] * 3, (host_totals, chunks)
    pytorch = results.pop("pytorch")
    for kernel, got in results.items():
        for quantity, got_value in got.items():
            want = pytorch[quantity]
            error = float((got_value - want).abs().max().detach() / want.abs().max().clamp(min=1e-6))
            print(f"{kernel} {quantity}: {error:.2e}")
            assert error < 1e-4, (kernel, quantity, error)
    print("kernels = pytorch")


if __name__ == "__main__":
    main()

"""flame's selective scan on CUDA (flame.models.kernels.selective_scan): its Triton kernels against the PyTorch
reference with document resets, up to a 340M layer's shape; fla's mamba and samba with it keep packed
documents apart; a 340M training step's speed and memory. Timings are printed (pytest -s). Skipped
where there is no CUDA device.

    bash tests/run.sh tests/gpu/test_mamba_scan_gpu.py -s -q
"""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from flame.models import load_model_config
from flame.models.registry import import_fla
from flame.models.kernels.selective_scan import reference_scan, triton_scan
from tests.conftest import ROOT, base_args, check, losses, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(DEVICE)


def documents(total: int, seed: int = 0) -> list[int]:
    """Document lengths filling ``total`` tokens, a few hundred to a few thousand each (a packed row)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(100, 3000, (1,), generator=generator)), total - sum(lengths)))
    return lengths


def scan_inputs(rows: int, length: int, channels: int, states: int, dtype=torch.float32) -> list[torch.Tensor]:
    """As fla's layer makes them: x, z views of in_proj's output; B, C views of x_proj's; float32 A, D, dt_bias."""
    torch.manual_seed(0)
    x, z = torch.randn(rows, length, 2 * channels, device=DEVICE, dtype=dtype).chunk(2, dim=-1)
    _, B, C = torch.split(torch.randn(rows, length, 64 + 2 * states, device=DEVICE, dtype=dtype),
                          [64, states, states], dim=-1)
    dt = (torch.randn(rows, length, channels, device=DEVICE) * 0.5 - 2.0).to(dtype)
    A = -torch.arange(1, states + 1, device=DEVICE, dtype=torch.float32).repeat(channels, 1)  # fla's init
    D, dt_bias = torch.ones(channels, device=DEVICE), torch.randn(channels, device=DEVICE) * 0.5 - 3.0
    return [v.detach().requires_grad_() for v in (x, dt, A, B, C, D, z, dt_bias)]


def relative_errors(tensors, cu_seqlens, **blocks) -> dict[str, float]:
    dout = torch.randn_like(tensors[0])
    got = triton_scan(*tensors, cu_seqlens=cu_seqlens, **blocks)
    got_grads = torch.autograd.grad(got, tensors, dout)
    upcast = [v.detach().float().requires_grad_() for v in tensors]  # the reference in float32 throughout
    want = reference_scan(*upcast, cu_seqlens=cu_seqlens)
    want_grads = torch.autograd.grad(want, upcast, dout.float())
    pairs = {"y": (got, want), **{f"d{n}": pair for n, pair in zip(NAMES, zip(got_grads, want_grads))}}
    return {name: ((a.float() - b).norm() / b.norm()).item() for name, (a, b) in pairs.items()}


@pytest.mark.parametrize("blocks", [{}, {"chunk": 32, "block_d": 64, "backward_block_d": 32},
                                    {"chunk": 128, "block_d": 16, "backward_block_d": 16}])
def test_kernels_match_the_reference_with_resets(blocks):
    tensors = scan_inputs(2, 300, 96, 16)
    errors = relative_errors(tensors, cu_seqlens_of([40, 64, 196, 1, 99, 200]), **blocks)
    print(f"\nfloat32, 2 x 300 tokens, {blocks or 'defaults'}: {errors}")
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_reference_at_a_340M_layers_shape(dtype):
    length = 8192
    tensors = scan_inputs(1, length, 2048, 16, dtype)
    errors = relative_errors(tensors, cu_seqlens_of(documents(length)))
    print(f"\n{dtype}, 1 x {length} tokens, D 2048, N 16: {errors}")
    # bf16: the kernels read the same bf16 inputs as the reference; they round their outputs to bf16
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 1e-2), errors


def _milliseconds(function, repeats: int = 10) -> float:
    function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@pytest.mark.parametrize("blocks", [{}, {"chunk": 32, "block_d": 32, "backward_block_d": 16},
                                    {"chunk": 128, "block_d": 32, "backward_block_d": 16},
                                    {"chunk": 64, "block_d": 64, "backward_block_d": 32}])
@pytest.mark.parametrize("length", [8192, 32768])
def test_kernel_timing(length, blocks):
    tensors = scan_inputs(1, length, 2048, 16, torch.bfloat16)
    cu_seqlens = cu_seqlens_of(documents(length))
    dout = torch.randn_like(tensors[0])

    def forward():
        with torch.no_grad():
            triton_scan(*tensors, cu_seqlens=cu_seqlens, **blocks)

    def forward_backward():
        torch.autograd.grad(triton_scan(*tensors, cu_seqlens=cu_seqlens, **blocks), tensors, dout)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd, both = _milliseconds(forward), _milliseconds(forward_backward)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"\nscan 1 x {length} tokens, D 2048, N 16, bf16, {blocks or 'defaults'}: forward {fwd:.2f} ms, "
          f"forward+backward {both:.2f} ms, {length / both * 1e3 / 1e6:.1f} M tokens/s per layer, "
          f"{peak:.0f} MiB above the inputs")


def _model(config, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(DEVICE)


@pytest.mark.parametrize("model_type", ["mamba", "samba"])
def test_a_packed_row_computes_its_documents_as_if_run_separately(model_type, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    config = load_model_config(str(ROOT / f"configs/tiny/{model_type}.json"))
    model = _model(config)
    lengths = [37, 300, 64, 111]
    ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), device=DEVICE)
    probe = torch.randn(sum(lengths), config.vocab_size, device=DEVICE)

    def run(pieces):
        model.zero_grad()
        logits = torch.cat([model(piece, use_cache=False, **kwargs).logits for piece, kwargs in pieces], dim=1)
        (logits[0] * probe).sum().backward()
        return logits, torch.cat([p.grad.flatten() for p in model.parameters()])

    packed = run([(ids, {"cu_seqlens": cu_seqlens_of(lengths)})])
    alone = run([(doc, {}) for doc in torch.split(ids, lengths, dim=1)])
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(packed, alone)]
    print(f"\n{model_type}: packed vs separate documents, relative error of logits, gradients: {errors}")
    assert max(errors) < 1e-4, errors


def test_flames_layer_is_flas_slow_path_on_one_document(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    import_fla()
    from fla.layers.mamba import Mamba

    torch.manual_seed(0)
    layer = Mamba(hidden_size=256, state_size=16, intermediate_size=512, layer_idx=0).to(DEVICE)
    hidden = torch.randn(2, 500, 256, device=DEVICE)
    results = []
    for slow in (False, True):
        copy_ = copy.deepcopy(layer)
        h = hidden.clone().requires_grad_()
        out = (copy_.slow_forward(h) if slow else copy_(h))[0]
        out.pow(2).mean().backward()
        results.append(torch.cat([out.flatten(), h.grad.flatten(), *(p.grad.flatten() for p in copy_.parameters())]))
    error = ((results[0] - results[1]).norm() / results[1].norm()).item()
    print(f"\nflame's Mamba path vs fla's slow path: relative error {error:.2e}")
    assert error < 1e-4


CONFIGS_340M = {
    "samba": str(ROOT / "configs/samba_340M.json"),
    # fla's mamba at the 340M scale (no configs/mamba_340M.json): 48 layers of width 1024
    "mamba": {"model_type": "mamba", "hidden_size": 1024, "num_hidden_layers": 48, "state_size": 16, "expand": 2,
              "conv_kernel": 4, "vocab_size": 32000, "tie_word_embeddings": False, "fuse_cross_entropy": False},
}


def _config(model_type: str):
    spec = CONFIGS_340M[model_type]
    if isinstance(spec, str):
        return load_model_config(spec)
    from transformers import AutoConfig

    import_fla()
    return AutoConfig.for_model(**spec)


@pytest.mark.parametrize("model_type, length", [("samba", 8192), ("mamba", 8192), ("samba", 32768)])
def test_340M_training_step(model_type, length):
    config = _config(model_type)
    model = _model(config)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (1, length + 1), device=DEVICE)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    cu_seqlens = cu_seqlens_of(documents(length))

    def step() -> float:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):  # as flame's one-GPU runs
            logits = model(inputs, cu_seqlens=cu_seqlens, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    try:
        first = step()  # Triton compiles and tunes here
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        last = [step() for _ in range(3)][-1]
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        pytest.skip(f"{model_type} ({params / 1e6:.0f}M) on one {length}-token row: out of memory without "
                    "activation checkpointing")
    seconds = (time.perf_counter() - start) / 3
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"\n{model_type} {params / 1e6:.0f}M, one row of {length} tokens ({len(cu_seqlens) - 1} documents), bf16 "
          f"autocast, no activation checkpointing: {seconds:.2f} s/step, {length / seconds:,.0f} tokens/s, "
          f"peak {peak:.1f} GiB; loss {first:.3f} -> {last:.3f}")
    assert torch.isfinite(torch.tensor(last)) and seconds < 60


@pytest.mark.parametrize("model_type, compile_", [("mamba", False), ("samba", False), ("mamba", True)])
def test_tiny_models_train_with_flame(tmp_path, corpus, model_type, compile_):
    dump = tmp_path / "run"
    args = [arg for arg in base_args(str(ROOT / f"configs/tiny/{model_type}.json"), corpus, dump, steps=30)
            if not arg.startswith("--training.seq_len")]
    args += ["--training.seq_len=512"] + (["--compile.enable"] if compile_ else [])
    result = check(torchrun(args))
    assert "fla.mamba_scans_documents" in result.stdout + result.stderr  # the startup log's changes
    curve = losses(dump)
    print(f"\n{model_type}{' compiled' if compile_ else ''}: loss {curve[1]:.2f} -> {curve[30]:.2f}")
    assert curve[30] < curve[1] - 0.5, curve

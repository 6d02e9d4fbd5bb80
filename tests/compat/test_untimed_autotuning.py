"""flame.compat.triton.untimed_autotuning, the memory plan's GPU probe's way past Triton's benchmarks, on Triton's
CPU interpreter: a kernel with no choice for its key runs its first configuration that runs, untimed, and nothing is
written to Triton's cache; a choice made before is kept; outside the block Triton tunes as before. (The interpreter
has no disk cache of choices: reading one there is upstream's own code, run on GPUs.)"""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.errors import OutOfResources  # noqa: E402

from flame.compat import triton as compat_triton  # noqa: E402


def _kernel(timings: dict[int, float] | None = None, refused: tuple[int, ...] = (), ran: list | None = None):
    """An autotuned kernel that writes its BLOCK into its output; ``timings`` stand in for Triton's benchmark
    (by BLOCK), ``refused`` configurations fail as one that does not compile fails, ``ran`` lists those run."""

    def hook(block):
        def pre_hook(nargs):
            if block in refused:
                raise OutOfResources(1 << 20, 1 << 16, "shared memory")
            if ran is not None:
                ran.append(block)
        return pre_hook if refused or ran is not None else None

    def bench(kernel_call, quantiles):
        kernel_call()
        return [timings[bench.block]] * 3

    configs = [triton.Config({"BLOCK": block}, pre_hook=hook(block)) for block in (4, 8, 16)]

    @triton.autotune(configs=configs, key=["n"], cache_results=True, do_bench=bench if timings else None)
    @triton.jit
    def fill(out, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(out + offsets, tl.full([BLOCK], BLOCK, tl.float32), mask=offsets < n)

    if timings:  # which configuration the stand-in benchmark is timing
        timed = fill._bench

        def _bench(*args, config, **meta):
            bench.block = config.kwargs["BLOCK"]
            return timed(*args, config=config, **meta)

        fill._bench = _bench
    return fill


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read as each kernel is decorated


def test_untimed_a_kernel_runs_its_first_configuration_that_runs_and_caches_no_choice(interpreted):
    ran = []
    fill, out = _kernel(refused=(4,), ran=ran), torch.zeros(16)
    with compat_triton.untimed_autotuning():
        fill[(1,)](out, 16)
    assert out.tolist() == [8.0] * 8 + [0.0] * 8  # 4 refused, 8 ran: 16 was neither compiled nor run
    assert ran == [8, 8]  # once in place of the benchmark, once for the call itself


def test_outside_the_block_triton_tunes_as_before_and_inside_a_choice_it_made_is_kept(interpreted):
    fill = _kernel(timings={4: 3.0, 8: 2.0, 16: 1.0})
    out = torch.zeros(16)
    fill[(1,)](out, 16)  # Triton's own tuning, timed by the stand-in: 16 wins
    assert out.tolist() == [16.0] * 16
    with compat_triton.untimed_autotuning():
        out = torch.zeros(16)
        fill[(1,)](out, 16)  # the key's choice: kept
        assert out.tolist() == [16.0] * 16
        out = torch.zeros(16)
        fill[(1,)](out, 2)  # a new key: the first configuration, untimed
        assert out.tolist() == [4.0] * 2 + [0.0] * 14
    out = torch.zeros(16)
    fill[(1,)](out, 3)  # a new key outside the block: tuned and timed again
    assert out.tolist() == [16.0] * 3 + [0.0] * 13

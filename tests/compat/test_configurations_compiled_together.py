"""flame.compat.triton.configurations_compiled_together: an autotuner's configurations for a new key are compiled side
by side on the compile threads before the first is timed, then timed from the kernel cache as upstream times them.

This machine has no GPU: Triton is shown an H100 (sm_90) by a driver stand-in that compiles (Triton's own compiler and
ptxas, for real) and launches nothing; the timing is a stand-in too. tests/gpu/test_kernel_warmup_gpu.py tunes on a GPU.
"""

import threading

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from flame.compat import triton as compat_triton  # noqa: E402


class _CompileOnlyHopper:
    """Triton's driver as far as compiling needs it: the current device, stream and target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(driver, "_active", _CompileOnlyHopper())  # the one before comes back after the test


def test_every_configuration_is_compiled_on_the_threads_before_the_first_timing(hopper, monkeypatch):
    import triton.compiler

    compat_triton.configurations_compiled_together(2)
    compiled_on = []
    compile_ = triton.compiler.compile

    def compile_spy(*args, **kwargs):  # the real compile, noting its thread
        compiled_on.append(threading.current_thread().name)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", compile_spy)  # read as the kernel binds to the device

    configs = [triton.Config({"BLOCK": block}, num_warps=warps) for block in (64, 128, 256) for warps in (2, 4)]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def scaled(x, out, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        value = tl.load(x + index, mask=index < n)
        tl.store(out + index, tl.exp(value) * 2 + tl.sqrt(value), mask=index < n)

    compiled_at_timing, timings = [], {64: 3.0, 128: 1.0, 256: 2.0}

    def bench(kernel_call, quantiles):  # what upstream's timing would measure; nothing launches
        compiled_at_timing.append(len(compiled_on))
        return [timings[bench.block]] * 3

    timed = scaled._bench

    def _bench(*args, config, **meta):
        bench.block = config.kwargs["BLOCK"]
        return timed(*args, config=config, **meta)

    scaled.__dict__["do_bench"] = bench
    scaled._bench = _bench
    x, out = torch.rand(1000), torch.empty(1000)
    with pytest.raises(AttributeError, match="launcher_cls"):  # the chosen kernel's launch: no GPU here
        scaled[(4,)](x, out, 1000)

    assert compiled_at_timing == [6] * 6  # all six compiled before the first timing, none during the timings
    assert all(thread.startswith("flame-triton-compile_") for thread in compiled_on)  # none on the calling thread
    assert len(scaled.fn.device_caches[0][0]) == 6  # each configuration in the kernel cache the timing reads
    assert scaled.best_config.kwargs["BLOCK"] == 128  # upstream's choice: the fastest

    # a key already chosen compiles nothing more; a one-configuration kernel is upstream's own path
    with pytest.raises(AttributeError, match="launcher_cls"):
        scaled[(4,)](x, out, 1000)
    assert len(compiled_on) == 6


def test_a_configuration_that_fails_to_compile_is_scored_as_upstream_scores_it(hopper):
    compat_triton.configurations_compiled_together(2)

    @triton.autotune(configs=[triton.Config({"BLOCK": block}) for block in (64, 128, 256)], key=["n"])
    @triton.jit
    def capped(x, n, BLOCK: tl.constexpr):
        tl.static_assert(BLOCK <= 128)  # the 256 configuration does not compile
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x + index, tl.load(x + index, mask=index < n) + 1, mask=index < n)

    def bench(kernel_call, quantiles):
        try:
            kernel_call()  # compiles where the kernel cache lacks the configuration, as upstream's timing does
        except AttributeError:  # compiled, and launched with no GPU here
            pass
        return [1.0] * 3

    capped.__dict__["do_bench"] = bench
    with pytest.raises(AttributeError, match="launcher_cls"):  # the chosen kernel's launch
        capped[(4,)](torch.rand(100), 100)
    assert len(capped.fn.device_caches[0][0]) == 2  # the two that compile, compiled together
    scores = {config.kwargs["BLOCK"]: timing[0] for config, timing in capped.configs_timings.items()}
    assert scores == {64: 1.0, 128: 1.0, 256: float("inf")}  # upstream's score for a configuration that fails


def test_a_rank_s_compile_threads_are_its_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(compat_triton.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert compat_triton.compile_threads() == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert compat_triton.compile_threads() == 1  # two CPUs a rank: compiles stay on the rank's thread
    monkeypatch.setenv("FLAME_COMPILE_THREADS", "1")  # the user's say: one after another
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert compat_triton.compile_threads() == 1
    for bad in ("four", "0"):
        monkeypatch.setenv("FLAME_COMPILE_THREADS", bad)
        with pytest.raises(compat_triton.ConfigError, match=f"FLAME_COMPILE_THREADS={bad}: give a number of threads"):
            compat_triton.compile_threads()


def test_a_bad_thread_count_stops_the_launch_before_the_ranks(monkeypatch, capsys):
    from flame.launch import preflight

    monkeypatch.setenv("FLAME_COMPILE_THREADS", "many")
    assert preflight.main(["--world-size", "1", "--", "--training.steps", "1"]) == 2
    assert "flame: error: FLAME_COMPILE_THREADS=many: give a number of threads" in capsys.readouterr().err

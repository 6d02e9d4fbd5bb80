"""flame.base.compile_watch: what Triton compiles in a process, said in the log while its first step waits, with how far
an autotuned kernel's tuning is (flame.compat.triton notes each autotuner's configuration count)."""

import re
import time

import triton
import triton.language as tl

from flame.base.compile_watch import CompileWatch


def test_the_compile_watch_says_what_step_one_compiles_and_keeps_the_hooks_it_found(monkeypatch):
    """Each compile framed by Triton's two hooks (a cache load, under LOADED_S, is not counted); while the step runs
    a line names the kernel compiling, and the how-many-th time for one that autotunes; a summary when it ends. A hook
    installed before (the kernel recorder) still gets every call."""
    import threading
    from types import SimpleNamespace

    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    recorded = []
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **hook: recorded.append(hook["fn"].name) and False)
    monkeypatch.setattr(CompileWatch, "EVERY_S", 0.05)
    monkeypatch.setattr(CompileWatch, "LOADED_S", 0.02)
    watch = CompileWatch()

    def call(name: str, seconds: float, finish: bool = True) -> None:
        hook = {"fn": SimpleNamespace(name=name), "key": None, "repr": name, "compile": {}, "is_manual_warmup": False,
                "already_compiled": False}
        assert runtime.jit_cache_hook(**hook) is False
        time.sleep(seconds)
        if finish:
            assert runtime.jit_post_compile_hook(**hook) is False

    for _ in range(3):
        call("chunk_fwd_kernel", 0.05)  # an autotuned kernel: one compile per configuration
    call("rms_norm_kernel", 0.0)  # loaded from the cache
    assert (watch.compiled, watch.per_kernel) == (3, {"chunk_fwd_kernel": 3})
    assert recorded == ["chunk_fwd_kernel"] * 3 + ["rms_norm_kernel"]

    lines, done = [], threading.Event()
    call("chunk_fwd_kernel", 0.0, finish=False)  # its 4th configuration, compiling now
    watch.report(lines.append, done.is_set)
    deadline = time.monotonic() + 5
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lines[0].startswith("step 1 is compiling Triton kernels: 3 so far") and \
        "now chunk_fwd_kernel for the 4th time (autotuning" in lines[0]
    assert lines[-1].startswith("step 1 compiled 3 Triton kernels")
    # with the autotuner's count (flame.compat.triton): how far, and about how long is left at the pace so far
    watch.tuning_sizes["chunk_fwd_kernel"] = 9
    assert re.fullmatch(r": autotuning, configuration 4 of 9 \(each compiled and timed once\), about 0 s left",
                        watch.tuning("chunk_fwd_kernel")), watch.tuning("chunk_fwd_kernel")
    assert watch.per_kernel_s["chunk_fwd_kernel"] / 3 * 6 < 0.5  # three compiles of ~0.05 s: six more, ~0.3 s


def test_the_autotuners_configuration_count_is_noted_per_kernel():
    """flame.compat.triton's change to Triton's autotuner: how many configurations a kernel is about to try, after
    its pruning, under the kernel's name (what the compile watch reads)."""
    from flame.compat import triton as compat_triton

    @triton.autotune(configs=[triton.Config({"BLOCK": block}) for block in (16, 32, 64)], key=["n"],
                     prune_configs_by={"early_config_prune": lambda configs, named_args, **_: configs[:2]})
    @triton.jit
    def tuned_copy(x, out, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + index, tl.load(x + index, mask=index < n), mask=index < n)

    compat_triton.autotuning_sizes_noted()
    tuned_copy.nargs = {"x": None, "out": None, "n": 4}
    assert len(tuned_copy.prune_configs({})) == 2
    assert compat_triton.tuning_sizes["tuned_copy"] == 2

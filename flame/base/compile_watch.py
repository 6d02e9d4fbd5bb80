"""What Triton compiles in this process, said in the log while a first step (or the memory plan's probe) waits for it.

Used by flame.compat.triton.compile_watch, which also tells it how many configurations each autotuned kernel tries.
"""

import time


class CompileWatch:
    """What Triton compiles in this process, said in the log while the first step waits for it.

    Triton compiles a kernel on its first call, inside the step, silently: a first step that takes
    minutes looks stuck. Triton's hooks frame each compile (``jit_cache_hook`` before, the post-compile
    hook after; a kernel loaded from the cache takes milliseconds and is not counted), and a thread
    says every ``EVERY_S`` seconds how many compiled so far and which one is compiling now (an
    autotuned kernel compiles once per configuration it tries), then one line when the step is done.
    """

    EVERY_S = 20.0
    LOADED_S = 0.1  # at most this long: read from Triton's cache, not compiled

    def __init__(self, tuning_sizes: dict[str, int] | None = None):
        """``tuning_sizes``: kernel name -> how many configurations its autotuner tries (flame.compat.triton keeps it
        filled), for the lines to say how far a kernel's tuning is and about how long it has left."""
        import triton

        self.tuning_sizes = {} if tuning_sizes is None else tuning_sizes
        self.compiled, self.seconds, self.per_kernel, self.per_kernel_s = 0, 0.0, {}, {}
        self.now: tuple[str, float] | None = None  # the kernel that started compiling last, and since when
        # compiles in flight, (kernel, Triton's key) -> since when: an autotuner's configurations compile side by side
        # (flame.compat.triton.configurations_compiled_together), so ``seconds`` is the time any was compiling
        self.in_flight: dict[tuple[str, str], float] = {}
        self.busy_since = 0.0
        runtime = triton.knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook  # kept: a recorder's, for one

        def starts(**hook) -> bool:
            name, now = hook["fn"].name, time.monotonic()
            if not self.in_flight:
                self.busy_since = now
            self.in_flight[name, hook["compile"].get("key")] = now
            self.now = (name, now)
            return bool(before and before(**hook))

        def ends(**hook) -> bool:
            name, now = hook["fn"].name, time.monotonic()
            since = self.in_flight.pop((name, hook["compile"].get("key")), None)
            if since is not None and (took := now - since) > self.LOADED_S:
                self.compiled += 1
                self.per_kernel[name] = self.per_kernel.get(name, 0) + 1
                self.per_kernel_s[name] = self.per_kernel_s.get(name, 0.0) + took
            if since is not None and not self.in_flight:  # none compiling now: the busy stretch counts, if a compile
                if (busy := now - self.busy_since) > self.LOADED_S:
                    self.seconds += busy
                self.now = None
            return bool(after and after(**hook))

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = starts, ends

    def report(self, log, done, what: str = "step 1") -> None:
        """Log progress every EVERY_S seconds until ``done()`` (``what`` has ended), then a summary line."""
        import threading

        def run() -> None:
            said = 0
            while not done():
                time.sleep(self.EVERY_S)
                if done() or (self.compiled == said and self.now is None):
                    continue
                said = self.compiled
                line = f"{what} is compiling Triton kernels: {self.compiled} so far ({self.seconds:.0f} s)"
                if self.now is not None:
                    line += f", now {self.now[0]}" + self.tuning(self.now[0])
                log(line + "; Triton's cache keeps them, so later runs on this machine skip this")
            if self.compiled:
                log(f"{what} compiled {self.compiled} Triton kernels ({self.seconds:.0f} s of it)")

        threading.Thread(target=run, name="flame-compile-watch", daemon=True).start()

    def tuning(self, name: str) -> str:
        """How far ``name``'s autotuning is, where it compiles for the third time or more: the configuration and, with
        the autotuner's count, about how long is left at the pace of its compiles so far."""
        tries = self.per_kernel.get(name, 0)
        if tries < 2:
            return ""
        if not (total := self.tuning_sizes.get(name)) or total <= tries:
            return f" for the {tries + 1}th time (autotuning: one compile per configuration it tries)"
        left = self.per_kernel_s[name] / tries * (total - tries)
        return (f": autotuning, configuration {tries + 1} of {total} (each compiled and timed once), about "
                f"{left:.0f} s left")

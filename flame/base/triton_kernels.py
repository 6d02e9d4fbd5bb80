"""Triton kernels compiled ahead of step 1, on the machine's spare CPUs, from a shipped list of those runs use.

    python -m flame.base.triton_kernels warm [--jobs N]     compile the kernels shipped for this GPU's architecture
    python -m flame.base.triton_kernels collect RECORDED... [--gpu NAME]   add recorded kernels to those shipped
    python -m flame.base.triton_kernels list                what is shipped, per Triton version, GPU and model type

The rule: fla's Triton kernels compile the first time each runs, one after another, inside the
process that runs them: a 340M fla model compiles 70-230 of them in the memory plan's GPU probe
and its first step, 53-100 s on an H100 even with every autotune choice shipped
(flame.base.autotune; docs/perf-log.md). A compile needs no GPU, only the target's name, and most
of its time is CPU (MLIR passes, ptxas). So the launcher starts ``warm`` before the job's check
(``start_warm_up``): it imports the kernels' modules, learns the job's model type from the check
once the check has parsed the job (a pipe: ``WarmUp``), and a pool of processes forked from it,
niced below the job, compiles that type's kernels shipped for this Triton version and the GPU's
architecture (recorded on this GPU or another of its kind: H100 and H200 are both sm_90) into
Triton's cache while the check probes and the ranks import, build the model and read their first
batch; the probe's and the ranks' first calls of a kernel then load it from the cache
(``FLAME_WARM_KERNELS=0`` turns it off). A kernel the list lacks compiles where it runs, as
before; a listed kernel the run never calls costs background CPU time only. Triton writes each
cache entry whole (a temporary file renamed), so a process compiling the same kernel meanwhile is
safe.

What is shipped: flame/base/autotune_choices/<triton version>/<gpu>/kernels.jsonl.gz, beside the
autotune choices, one line a kernel (gzipped JSON lines): its module, its name, the model types that compiled it, the
GPU target and Triton's own specialization record (what ``JITFunction.preload`` reads: signature,
constants, options). Record them by running the standard jobs once on that GPU with
``FLAME_RECORD_KERNELS=<file>`` (the job's check and each rank append every kernel they compile:
``record_compiled_kernels``), then ``collect`` the file (after ``python -m flame.base.autotune collect``: the
configurations an autotuner timed and did not choose are left out by the choices shipped beside the list).
Like the autotune choices, a list goes stale with a new Triton or fla (the kernels' source changes their cache key):
``python -m flame.base.autotune collect --replace`` drops it with them.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from pathlib import Path

from flame.base.autotune import CHOICE_SUFFIX, SHIPPED, gpu_name, triton_version
from flame.base.process import die_with_parent

KERNELS = "kernels.jsonl.gz"  # shipped gzipped: each line's specialization record is long and alike (1.3 MB -> 33 KB)
RECORD = "FLAME_RECORD_KERNELS"  # a file: every Triton kernel the job's check or a rank compiles is appended to it
NVIDIA_DEVICE = Path("/dev/nvidiactl")  # present where an NVIDIA driver is loaded
SWITCH = "FLAME_WARM_KERNELS"  # "0" (or false/no/off): no warm-up (CPUs shared with other jobs, or timing a cold start)


def record_compiled_kernels(path: str, model_type: str) -> None:
    """Append every Triton kernel this process compiles from now on to ``path`` (JSON lines), as ``collect`` reads it,
    each marked as ``model_type``'s (the warm-up compiles only the job's type's kernels).

    Triton calls ``knobs.runtime.jit_post_compile_hook`` after compiling a kernel or loading it from its cache,
    with its specialization record; the GPU target is this process's. A hook already there (a compile watch's) is
    called too.
    """
    import triton

    previous = triton.knobs.runtime.jit_post_compile_hook

    def hook(*, fn, compile, **rest) -> bool:
        target = _current_target()
        line = {"module": fn.module, "name": fn.name, "spec": compile["specialization_data"], "models": [model_type],
                "target": {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}}
        with open(path, "a") as file:  # one write a line: the ranks of a run may share the file
            file.write(json.dumps(line) + "\n")
        return bool(previous and previous(fn=fn, compile=compile, **rest))

    triton.knobs.runtime.jit_post_compile_hook = hook


def model_type_of(model_config: str) -> str:
    """The ``model_type`` of the model config a job names (a JSON file, or a folder holding config.json); "" where it
    cannot be read here, e.g. a hub name (the warm-up then compiles every kernel shipped for the GPU's architecture)."""
    path = Path(model_config)
    try:
        return str(json.loads((path / "config.json" if path.is_dir() else path).read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _current_target():
    from triton.runtime.driver import driver

    return driver.active.get_current_target()


def shipped_folders(root: Path = SHIPPED) -> list[Path]:
    return sorted(path.parent for path in root.glob(f"*/*/{KERNELS}")) if root.is_dir() else []


def read(path: Path) -> list[dict]:
    """The kernels in a shipped list (gzipped) or a recorded file (plain JSON lines)."""
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as file:
        return [json.loads(line) for line in file if line.strip()]


def collect(recorded: list[Path], gpu: str, root: Path = SHIPPED) -> Path:
    """Add the kernels in the ``recorded`` files to those shipped for ``gpu`` under this Triton version, each once (in
    the order first seen: the order runs need them) with every model type that compiled it, leaving out kernels no
    process could import again (torch's inductor writes its own to temporary modules) and the configurations an
    autotuner timed and did not choose (``autotune_losers``). Returns the shipped file."""
    version = triton_version()
    target = root / version / gpu / KERNELS
    kernels: dict[tuple[str, str, str], dict] = {}
    for kernel in [*(read(target) if target.exists() else []), *(k for path in recorded for k in read(path))]:
        if kernel["module"].startswith("torch._inductor"):
            continue
        key = (kernel["module"], kernel["name"], kernel["spec"])
        known = kernels.setdefault(key, {**kernel, "models": []})
        known["models"] = sorted({*known["models"], *kernel.get("models", [])})
    losing = autotune_losers(root / version)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{KERNELS}.{os.getpid()}.partial")
    lines = "".join(json.dumps(kernel) + "\n" for kernel in kernels.values() if not losing(kernel))
    partial.write_bytes(gzip.compress(lines.encode(), mtime=0))  # no timestamp: the same list, the same bytes
    os.replace(partial, target)
    return target


def autotune_losers(choices: Path) -> Callable[[dict], bool]:
    """Whether a recorded kernel is a configuration its autotuner timed and chose for none of its keys, by the choices
    shipped under ``choices`` (one Triton version's folders, every GPU's).

    A cold run compiles every configuration of each kernel it tunes (up to 135 for fla rwkv7's): its record lists
    them all, while a run with the choices shipped compiles only the chosen one. Compiling the losers ahead would
    spend the warm-up's CPUs on kernels no run loads (459 of the 874 recorded for the H100's 340M runs). A kernel
    whose autotuner has no shipped choice keeps all of its configurations: which one a run needs is not known yet.
    """
    timed: dict[str, list[tuple]] = {}
    chosen: dict[str, list[tuple]] = {}
    for path in sorted(choices.glob(f"*/*/*{CHOICE_SUFFIX}")):
        name = path.name.removesuffix(CHOICE_SUFFIX)
        timings = json.loads(path.read_text())["configs_timings"]  # [[config, [median, p20, p80] ms], ...]
        timed.setdefault(name, []).extend(_config(config) for config, _ in timings)
        chosen.setdefault(name, []).append(_config(min(timings, key=lambda pair: pair[1])[0]))

    def losing(kernel: dict) -> bool:
        if kernel["name"] not in timed:
            return False
        spec = json.loads(kernel["spec"])
        names = list(spec.get("signature", {}))
        constants = {names[at[0]]: value for at, value in zip(spec.get("constant_keys", []), spec.get("constant_vals", []))
                     if len(at) == 1}
        options = spec.get("options", {})

        def compiled(config: tuple) -> bool:  # the kernel is this configuration, compiled
            arguments, warps, stages = config
            return (warps == options.get("num_warps") and stages == options.get("num_stages")
                    and all(constants.get(name) == value for name, value in arguments))

        return any(map(compiled, timed[kernel["name"]])) and not any(map(compiled, chosen[kernel["name"]]))

    return losing


def _config(config: dict) -> tuple:
    """An autotune choice file's configuration: (its constexpr arguments, num_warps, num_stages)."""
    return tuple(sorted(config["kwargs"].items())), config["num_warps"], config["num_stages"]


def for_model(kernels: list[dict], model_type: str) -> list[dict]:
    """The kernels a job of ``model_type`` compiles: those recorded for it (all, where the type is not known)."""
    return [kernel for kernel in kernels if not model_type or model_type in kernel.get("models", [model_type])]


def compile_kernel(kernel: dict) -> str | None:
    """Compile one shipped kernel into Triton's cache, as its first call in a rank would (``JITFunction.preload``'s
    steps, for the named target instead of the current device); None, or why it could not."""
    try:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import JITFunction

        function = importlib.import_module(kernel["module"])
        for part in kernel["name"].split("."):
            function = getattr(function, part)
        while not isinstance(function, JITFunction):  # under its autotuner and heuristics wrappers
            function = function.fn
        spec = json.loads(kernel["spec"])
        target = GPUTarget(**kernel["target"])
        constants = {
            tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value) else
            tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
            for key, value in zip(spec["constant_keys"], spec["constant_vals"])
        }
        attrs = {tuple(key): value for key, value in zip(spec["attrs_keys"], spec["attrs_vals"])}
        signature = {name: tuple(kind) if isinstance(kind, list) else kind for name, kind in spec["signature"].items()}
        options = make_backend(target).parse_options(
            {name: tuple(value) if isinstance(value, list) else value for name, value in spec["options"].items()})
        compile(ASTSource(function, signature, constants, attrs), target=target, options=options.__dict__)
        return None
    except Exception as error:  # one kernel that fails only leaves it to the rank
        first_line = (str(error).splitlines() or [""])[0][:200]
        return f"{kernel['module']}.{kernel['name']}: {type(error).__name__}: {first_line}"


def _worker_start(parent: int) -> None:
    os.nice(10)  # behind the ranks, their data loaders and the job's check
    die_with_parent(signal.SIGKILL, parent)


def warm(kernels: list[dict], jobs: int, model_type: Callable[[], str] = str) -> tuple[int, int, list[str]]:
    """Compile those of ``kernels`` that are ``model_type()``'s (asked once the modules are imported: the job's check
    tells it meanwhile) on ``jobs`` processes; (how many were the type's, how many compiled, why the others did not).

    The kernels' modules (fla imports torch and transformers: seconds of CPU) are imported once, here, and the pool
    forks from this process with them loaded: 14 processes importing them side by side, beside the ranks doing the
    same, took 35 s on an H100 machine's 16 cores, longer than the ranks took to reach step 1. A CUDA state the
    imports may set up (fla asks for the device as it loads) is never used by the children: a compile names its
    target and calls no driver."""
    for module in dict.fromkeys(kernel["module"] for kernel in kernels):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 -- compile_kernel says why, for each of its kernels
            pass
    kernels = for_model(kernels, model_type())
    if not kernels:  # none recorded for this type: no pool to start
        return 0, 0, []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start,
                             initargs=(os.getpid(),)) as pool:
        failures = [failure for failure in pool.map(compile_kernel, kernels, chunksize=1) if failure]
    return len(kernels), len(kernels) - len(failures), failures


def first_gpu() -> tuple[str, int | None]:
    """This machine's first GPU: its name as autotune.gpu_name writes it, and its architecture as Triton's target
    names it (compute capability 9.0: 90; None where the driver does not say), asked of nvidia-smi (no CUDA in this
    process: the pool forks from it)."""
    def ask(field: str) -> str:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, check=True).stdout.strip()

    name = ask("name").replace(" ", "-").replace("/", "-")
    try:
        major, minor = ask("compute_cap").split(".")
        return name, int(major) * 10 + int(minor)
    except (subprocess.CalledProcessError, ValueError):
        return name, None


def shipped_for(gpu: str, arch: int | None, root: Path = SHIPPED) -> list[dict]:
    """The kernels shipped for this Triton version that compile for this GPU, each once: its own folder's, then those
    recorded on any other GPU of its architecture (a compile names only the target: an H200 compiles an H100's list,
    both sm_90, and reads the H100's autotune choices, which flame.base.autotune installs for both)."""
    folders = sorted((root / triton_version()).glob(f"*/{KERNELS}"), key=lambda path: path.parent.name != gpu)
    kernels: dict[tuple[str, str, str], dict] = {}
    for path in folders:
        if path.parent.name == gpu or arch is not None:
            for kernel in read(path):
                if path.parent.name == gpu or kernel["target"].get("arch") == arch:
                    kernels.setdefault((kernel["module"], kernel["name"], kernel["spec"]), kernel)
    return list(kernels.values())


class WarmUp:
    """The launcher's background compile: its process, and the pipe on which the job's check, a process forked from the
    launcher, tells it the job's model type once the config is parsed (the launcher itself parses nothing)."""

    def __init__(self, process: subprocess.Popen, told: int):
        self.process, self._told = process, told

    def tell(self, model_type: str) -> None:
        """In the job's check: name the job's model type ("": every kernel), once."""
        try:
            os.write(self._told, (model_type + "\n").encode())
        except OSError:  # it has ended (no kernel for this machine): nothing to tell
            pass
        self.release()

    def release(self) -> None:
        """In the launcher, once the check holds its own end: a check that ends without telling then means "every
        kernel" (the read sees the end), and the ranks, forked later, hold no end that keeps it waiting."""
        if self._told >= 0:
            os.close(self._told)
            self._told = -1

    def stop(self) -> None:
        self.release()
        if self.process.poll() is None:  # the run ended before it: its work is of no more use
            self.process.terminate()


def start_warm_up() -> WarmUp | None:
    """Start ``warm`` in the background (the launcher, before the job's check); None where nothing is shipped for
    this machine's Triton, the machine has no NVIDIA GPU, or FLAME_WARM_KERNELS=0. Asks neither torch nor Triton:
    the launcher imports neither before the ranks fork from it."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
    if not list((SHIPPED / version).glob(f"*/{KERNELS}")) or not NVIDIA_DEVICE.exists():
        return None
    jobs = max(1, (os.cpu_count() or 2) - 2)
    read, told = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "flame.base.triton_kernels", "warm", "--jobs", str(jobs),
                                "--parent", str(os.getpid()), "--model_from", str(read)], stdin=subprocess.DEVNULL,
                               pass_fds=(read,))
    os.close(read)
    return WarmUp(process, told)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flame.base.triton_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("warm", "collect", "list"))
    parser.add_argument("recorded", nargs="*", type=Path, help="collect: files written under FLAME_RECORD_KERNELS")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="warm: processes")
    parser.add_argument("--parent", type=int, help="warm: stop when this process (the launcher) ends")
    parser.add_argument("--model_from", type=int, help="warm: a pipe on which the job's model type comes (WarmUp)")
    parser.add_argument("--gpu", help="collect: the GPU the files were recorded on, as autotune names it (e.g. "
                                      "NVIDIA-H100-80GB-HBM3; default: this machine's)")
    args = parser.parse_args(argv)
    if args.action == "warm":
        if args.parent:
            die_with_parent(signal.SIGTERM, args.parent)
        try:
            kernels = shipped_for(*first_gpu(), root=SHIPPED)
        except (OSError, subprocess.CalledProcessError):  # no nvidia-smi answer: the ranks compile as before
            return 0
        if not kernels:
            return 0
        started = time.monotonic()
        told = (lambda: os.fdopen(args.model_from).readline().strip()) if args.model_from is not None else str
        mine, compiled, failures = warm(kernels, args.jobs, told)
        if not mine:  # a model type no shipped run recorded: its ranks compile as before
            return 0
        print(f"flame: {compiled} of the {mine} Triton kernels shipped for this GPU's architecture and model type are "
              f"in Triton's cache ({time.monotonic() - started:.0f} s on {args.jobs} processes beside the ranks' start)"
              + (f"; {len(failures)} left to the ranks, e.g. {failures[0]}" if failures else ""), flush=True)
    elif args.action == "collect":
        if not args.recorded:
            parser.error("collect: name the files written under FLAME_RECORD_KERNELS")
        path = collect(args.recorded, args.gpu or gpu_name())
        print(f"flame: {len(read(path))} kernels now shipped in {path}")
    else:
        for folder in shipped_folders(SHIPPED):
            kernels = read(folder / KERNELS)
            types = sorted({model for kernel in kernels for model in kernel.get("models", [])})
            per_type = ", ".join(f"{model} {len(for_model(kernels, model))}" for model in types)
            print(f"triton {folder.parent.name}, {folder.name}: {len(kernels)} kernels"
                  + (f" ({per_type})" if types else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

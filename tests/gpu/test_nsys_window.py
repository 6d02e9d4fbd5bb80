"""The Nsight Systems window (--profiling.nsys_start_step/nsys_stop_step) on a GPU.

What the training process tells a profiler is recorded by tests/gpu/nvtx_recorder.c, built here
with the machine's C compiler: loaded as the process's NVTX tool it records every range pushed
and popped, and preloaded it records the CUDA runtime's cudaProfilerStart/Stop calls. Where
Nsight Systems is installed, a real capture is checked too.
"""

import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, base_args, check, flame_env, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WINDOW = ["--profiling.nsys_start_step=2", "--profiling.nsys_stop_step=4"]  # steps 2 and 3
PARTS = ["data", "forward", "backward", "optimizer"]


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the NVTX recorder")
    library = tmp_path_factory.mktemp("recorder") / "libnvtx_recorder.so"
    check(subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                          str(ROOT / "tests" / "gpu" / "nvtx_recorder.c"), "-ldl"], capture_output=True, text=True))
    return library


def top_level(lines: list[str]) -> list[tuple[str, list[str]]]:
    """The training rank's events as (outermost range or profiler call, names of the ranges directly inside it)."""
    events = [line.split(" ", 2) + [""] for line in lines]
    rank = next(pid for pid, event, message, *_ in events if event == "push" and message == "step 1")
    outer, depth = [], 0
    for pid, event, message, *_ in events:
        if pid != rank:
            continue
        if event.startswith("cudaProfiler"):
            outer.append((event, []))
        elif event == "push":
            if depth == 0:
                outer.append((message, []))
            elif depth == 1:
                outer[-1][1].append(message)
            depth += 1
        elif event == "pop":
            depth -= 1
    return outer


def test_the_profiler_runs_around_the_window_and_nvtx_marks_every_step(tmp_path, tiny_model, corpus, recorder):
    record = tmp_path / "record.txt"
    env = {"NVTX_INJECTION64_PATH": str(recorder), "LD_PRELOAD": str(recorder), "FLAME_PROFILER_RECORD": str(record)}
    args = base_args(tiny_model, corpus, tmp_path / "run", steps=5) + ["--checkpoint.no-enable", *WINDOW]
    check(torchrun(args, env=env))
    outer = [(name, [part for part in inside if part in PARTS]) for name, inside in top_level(record.read_text().splitlines())
             if name.startswith(("step ", "cudaProfiler"))]
    steps = {n: (f"step {n}", PARTS) for n in range(1, 6)}
    assert outer == [steps[1], ("cudaProfilerStart", []), steps[2], steps[3], ("cudaProfilerStop", []), steps[4], steps[5]]


def test_nsys_captures_the_window_only(tmp_path, tiny_model, corpus):
    nsys = shutil.which("nsys")
    if nsys is None:
        pytest.skip("Nsight Systems (nsys) is not installed")
    report = tmp_path / "window"
    args = base_args(tiny_model, corpus, tmp_path / "run", steps=5) + ["--checkpoint.no-enable", *WINDOW]
    check(subprocess.run([nsys, "profile", "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "-t",
                          "cuda,nvtx", "-o", str(report), "--force-overwrite=true", sys.executable, "-m",
                          "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "flame.train", *args],
                         cwd=ROOT, env=flame_env(), capture_output=True, text=True, timeout=600))
    stats = check(subprocess.run([nsys, "stats", "--report", "nvtx_sum", "--format", "csv", "--output", "-",
                                  f"{report}.nsys-rep"], capture_output=True, text=True))
    ranges = {row.get("Range", "").lstrip(":") for row in csv.DictReader(io.StringIO(stats.stdout[stats.stdout.index("Time"):]))}
    assert {"step 2", "step 3", *PARTS} <= ranges
    assert not {"step 1", "step 4", "step 5"} & ranges

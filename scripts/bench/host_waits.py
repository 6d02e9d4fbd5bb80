"""Where a training step makes the host wait for the GPU: the Python lines of its synchronizing calls.

    torchrun --standalone --nproc_per_node 1 -m scripts.bench.host_waits [--at-step N] <train.sh flags>

Trains with flame's Trainer. During step N (default 5: past the first steps' one-time work) torch's
CUDA sync debug mode is on, which warns at every call that blocks the host until the GPU has
finished (``.item()``, ``.tolist()``, ``if tensor:``, ``int(tensor)``, a copy from the GPU, ...).
Each place is printed once, with the number of times the step reached it: the innermost frames
outside torch, which is where the call came from. torch calls the mode a prototype and it does
not catch every synchronizing op; a profiled step's trace counts all of them, by host op rather
than by line (scripts/bench/trace_summary.py). On a CPU run nothing is reported.
"""

import os
import sys
import tempfile
import traceback
import warnings
from collections import Counter

import torch

FRAMES_SHOWN = 6  # innermost frames outside torch, per place
# frames that are the warning's machinery or torch's own code, not the caller's
SKIPPED = (f"{os.sep}torch{os.sep}", f"{os.sep}warnings.py", __file__)


def place(stack: list[traceback.FrameSummary]) -> tuple[str, ...]:
    """The innermost ``FRAMES_SHOWN`` frames of ``stack`` (outermost first) outside torch, as text, innermost last."""
    frames = [frame for frame in stack if not any(part in frame.filename for part in SKIPPED)]
    return tuple(f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in frames[-FRAMES_SHOWN:])


def report(places: Counter) -> str:
    """The places, most visited first, each with its count."""
    total = sum(places.values())
    lines = [f"{total} synchronizing call{'s' if total != 1 else ''} at {len(places)} place{'s' if len(places) != 1 else ''}"]
    for frames, count in places.most_common():
        lines.append(f"{count:5d}x  " + ("\n        ".join(frames) or "(torch's own frames only)"))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from torchtitan.tools.logging import init_logger

    from flame.base import autotune
    from flame.prepare import prepared
    from flame.training.trainer import Trainer

    init_logger()
    autotune.share_triton_cache()  # the kernels and autotune choices train.sh's runs use
    at_step = 5
    if argv[:1] == ["--at-step"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            raise SystemExit(f"host_waits: error: --at-step takes a step number (1 or more), got "
                             f"{argv[1] if len(argv) > 1 else 'nothing'}: e.g. --at-step 5")
        at_step, argv = int(argv[1]), argv[2:]
    if not any(arg.startswith("--job.dump_folder") for arg in argv):  # nothing of this run is kept
        argv = [*argv, "--job.dump_folder", tempfile.mkdtemp(prefix="flame-host-waits-")]
    places: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            places[place(traceback.extract_stack())] += 1

    class WatchedTrainer(Trainer):
        def train_step(self, data_iterator):
            if self.step != at_step or not torch.cuda.is_available():
                return super().train_step(data_iterator)
            with warnings.catch_warnings():  # restores the filters and showwarning after the step
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    super().train_step(data_iterator)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            if torch.distributed.get_rank() == 0:
                print(f"host waits of step {at_step}:\n{report(places)}", flush=True)

    trainer = WatchedTrainer(prepared(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

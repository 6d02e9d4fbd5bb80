"""Train with flame (flame.train.main: its error handling too), but the checkpoint saves of the steps in
FLAME_TEST_FAILED_SAVES fail as on a full disk: rank FLAME_TEST_FAILING_RANK (default 0) writes part of its file,
then gets ENOSPC. Every other write is DCP's own."""

import errno
import os
import sys

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from flame.train import end_process, main

FAILED = {int(step) for step in os.environ["FLAME_TEST_FAILED_SAVES"].split(",")}
RANK = int(os.environ.get("FLAME_TEST_FAILING_RANK", "0"))
_write_data = FileSystemWriter.write_data


def write_data(self, plan, planner):
    step = int(os.path.basename(os.fspath(self.path)).removeprefix("step-"))
    if step in FAILED and torch.distributed.get_rank() == RANK:
        path = os.path.join(os.fspath(self.path), f"__{RANK}_0.distcp")
        with open(path, "wb") as file:
            file.write(b"the first bytes of a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = write_data

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))

"""Optimizer work on a host thread: ``HostWorker``, one thread running queued work in order for a streamed model
(flame.optim.streaming: its gradients' sums over micro-batches, then each unit's update), and ``SettlesFirst``,
what such an optimizer's state reads and loads wait for."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class HostWorker:
    """One host thread running queued work in order (gradient sums, then the step's units); an error in it is
    raised on the training thread at its next wait."""

    def __init__(self, on_error: Callable[[], None]) -> None:
        self.on_error = on_error
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.error: BaseException | None = None
        self._scratch = torch.empty(0, dtype=torch.float32)
        self.thread = threading.Thread(target=self._run, name="flame-weight-stream", daemon=True)
        self.thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def drain(self) -> None:
        self.jobs.join()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            cause = f"{type(self.error).__name__}: {(str(self.error).splitlines() or [''])[0]}"
            raise RuntimeError(f"--memory.stream_weights: the host's work failed ({cause})") from self.error

    def scratch(self, numel: int) -> torch.Tensor:
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=torch.float32)
        return self._scratch[:numel]

    @torch.no_grad()
    def _run(self) -> None:
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))  # one core left to the thread launching the GPU's work
        while True:
            job = self.jobs.get()
            try:
                if self.error is None:
                    job()
            except BaseException as error:  # noqa: BLE001 - raised on the training thread by check()
                self.error = error
                self.on_error()
            finally:
                self.jobs.task_done()


class SettlesFirst:
    """For an optimizer (or container) whose update may still run on a host thread: reading or loading its state
    waits for that update first (its ``settle``)."""

    def state_dict(self):
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.settle()
        super().load_state_dict(state_dict)

"""lm-eval scores during training: each saved checkpoint of an evaluation step, scored in the background.

--eval.tasks (with --eval.interval, default: every checkpoint step) hands each such step, once
its manifest is written (the step is complete and loads), to ``python -m flame.eval --model
<dump_folder> --step N`` in a process of rank 0's own, one evaluation at a time, in step order.
That process writes <dump_folder>/eval/step-N/ and appends the scores to metrics.jsonl (whole
lines: flame.base.run_record.append_metrics) and TensorBoard; the trainer adds them to W&B. Its
output goes to <dump_folder>/eval/step-N/flame_eval.log. It runs on rank 0's device (on a GPU
it shares the GPU and its memory with training) or on the CPU (--eval.device cpu), and dies
with rank 0. At the end of a run that finished, training waits for the evaluations still to
come; a run that fails stops its evaluation in progress and says which.
"""

import os
import queue
import signal
import subprocess
import sys
import threading

from flame.base import run_record


LOG = "flame_eval.log"


class BackgroundEvaluations:
    """Rank 0's evaluations of saved steps, run one at a time by a thread of their own."""

    def __init__(self, config, device: str, log, wandb_run=None):
        self.config, self.device, self.log, self.wandb_run = config, device, log, wandb_run
        self.dump_folder = config.job.dump_folder
        self.queue: queue.Queue = queue.Queue()
        self._pending: set[int] = set()  # queued or running: the checkpointer keeps these steps
        self._pending_lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name="flame-evaluations", daemon=True)
        self.thread.start()

    def command(self, step: int) -> list[str]:
        e = self.config.eval
        options = {"--include_path": e.include_path, "--limit": e.limit, "--num_fewshot": e.num_fewshot}
        return [sys.executable, "-m", "flame.eval", "--model", self.dump_folder, "--step", str(step),
                "--tasks", e.tasks, "--batch_size", str(e.batch_size), "--device", self.device,
                *[str(x) for name, value in options.items() if value is not None for x in (name, value)]]

    def saved(self, checkpoint: str) -> None:
        """A step's checkpoint is complete (its manifest written): score it if it is an evaluation step."""
        name = os.path.basename(checkpoint)
        step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
        interval = self.config.eval.interval
        if step and (not interval or step % interval == 0):
            with self._pending_lock:
                self._pending.add(step)
            self.queue.put(step)

    def pending(self) -> set[int]:
        """The steps queued or being evaluated."""
        with self._pending_lock:
            return set(self._pending)

    def _done(self, step: int) -> None:
        with self._pending_lock:
            self._pending.discard(step)
        self.queue.task_done()

    def _run(self) -> None:
        while (step := self.queue.get()) is not None:
            try:
                self._evaluate(step)
            except Exception as error:  # the thread lives on: close() must return
                self.log.warning(f"evaluation of step {step} failed to start: {error}")
            finally:
                self._done(step)
        self.queue.task_done()

    def _evaluate(self, step: int) -> None:
        folder = os.path.join(self.dump_folder, "eval", f"step-{step}")
        os.makedirs(folder, exist_ok=True)
        log_path = os.path.join(folder, LOG)
        # it dies with this rank (flame.base.process.die_with_parent, through FLAME_PARENT_PID)
        env = {**os.environ, "FLAME_PARENT_PID": str(os.getpid())}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # a process of its own, not one of the training job's ranks
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(self.command(step), stdout=log, stderr=subprocess.STDOUT, env=env)
            self.log.info(f"evaluating step {step} in the background (pid {self.process.pid}, {self.config.eval.tasks} "
                          f"on {self.device}); its log: {log_path}")
            status = self.process.wait()
        if status != 0:
            lines = [line.strip() for line in open(log_path, errors="replace") if line.strip()]
            self.log.warning(f"evaluation of step {step} failed (exit {status}): {lines[-1] if lines else 'no output'}; "
                             f"its log: {log_path}")
            return
        scores = run_record.eval_scores(self.dump_folder).get(step, {})
        self.log.info(f"step {step} scores: " + ", ".join(f"{name} {value:.4f}" for name, value in scores.items()))
        if self.wandb_run is not None and scores:
            try:
                self.wandb_run.log({**{f"eval/{k}": v for k, v in scores.items()}, "eval/step": step})
            except Exception as error:  # best effort: the scores are in metrics.jsonl whatever W&B does
                self.log.warning(f"W&B did not take the scores of step {step}: {error}")

    def close(self, wait: bool) -> None:
        """Wait for the evaluations queued so far (``wait``), or stop the one running and drop the rest."""
        if not wait:
            while not self.queue.empty():
                step = self.queue.get_nowait()
                self.log.warning(f"evaluation of step {step} not run: training stopped")
                self._done(step)
            if self.process is not None and self.process.poll() is None:
                self.log.warning(f"stopping the evaluation in progress (pid {self.process.pid}): training stopped")
                self.process.send_signal(signal.SIGTERM)
        elif self.queue.unfinished_tasks:
            self.log.info("waiting for the evaluations of saved steps to finish (--eval.tasks)")
        self.queue.put(None)
        self.thread.join()


def build(config, checkpointer, log) -> BackgroundEvaluations | None:
    """Rank 0's background evaluations of the steps ``checkpointer`` saves (None: no --eval.tasks, or another rank)."""
    import torch

    if not config.eval.tasks.strip() or torch.distributed.get_rank() != 0 or checkpointer.recorder is None:
        return None
    device = config.eval.device
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    wandb_run = None
    if config.metrics.enable_wandb and (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:
        wandb_run = wandb.run  # the scores against their own step axis: W&B's steps only go forward
        wandb_run.define_metric("eval/step")
        wandb_run.define_metric("eval/*", step_metric="eval/step")
    evaluations = BackgroundEvaluations(config, device, log, wandb_run)
    checkpointer.recorder.on_recorded = evaluations.saved
    checkpointer.steps_in_use = evaluations.pending
    return evaluations

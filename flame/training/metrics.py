"""Training metrics: console line, TensorBoard and W&B, built on torchtitan's MetricsProcessor.

Every logged step also goes to <dump_folder>/metrics.jsonl (one JSON object per line, naming the
attempt that wrote it: a resumed run logs again the steps after its checkpoint, and a reader keeps
the latest attempt's record of a step; flame.base.dump_folder). A write to metrics.jsonl, TensorBoard
or W&B that fails is a warning, never the end of the run (flame.training.side_outputs).
Throughput is tokens per second per device (all tokens fed to the model). TFLOPS and MFU
count the FLOPs of the batches really trained on (flame.models.flops: matmuls, softmax
attention over each batch's real documents, linear-attention/SSM terms) against the
device's bf16 dense peak.
"""

import datetime
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.metrics import (
    LoggerContainer,
    MetricsProcessor,
    build_device_memory_monitor,
)
from torchtitan.tools import utils
from torchtitan.tools.logging import logger


from flame.base import device, run_record
from flame.models import loss, moe
from flame.training import side_outputs


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _use_offline_wandb_without_credentials() -> None:
    # wandb.init would wait for a login (or the network) forever; offline runs sync later.
    has_netrc = os.path.isfile(os.path.expanduser("~/.netrc"))
    if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ and not has_netrc:
        os.environ["WANDB_MODE"] = "offline"
        logger.info("W&B: no credentials found, logging offline (sync later with `wandb sync`)")
    os.environ.setdefault("WANDB_PROJECT", "flame")


class JsonlLogger:
    """Appends each logged step as one JSON line to <dump_folder>/metrics.jsonl (rank 0), with its attempt.

    Each line is one append (run_record.append_metrics): evaluations running beside the trainer
    (flame.training.evaluation) add their lines to the same file.
    """

    def __init__(self, dump_folder: str):
        self.dump_folder = dump_folder  # the file is created at the first step: a run that fails before it writes nothing
        self.attempt: int | None = None  # set by the trainer as the run starts

    def log(self, metrics: dict[str, Any], step: int) -> None:
        os.makedirs(self.dump_folder, exist_ok=True)
        run_record.append_metrics(self.dump_folder, {"step": step, "attempt": self.attempt, **metrics})

    def close(self) -> None:
        pass


class FlameMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        # Not calling MetricsProcessor.__init__: it would guess A100 peak FLOPS on a CPU.
        if job_config.metrics.enable_wandb:
            _use_offline_wandb_without_credentials()
        self.logger = LoggerContainer()
        self.logger.add_logger(side_outputs.tensorboard_and_wandb(job_config, parallel_dims, tag))
        self.jsonl = None
        if torch.distributed.get_rank() == 0:
            self.jsonl = JsonlLogger(job_config.job.dump_folder)
            self.logger.add_logger(side_outputs.NonFatalLogger(self.jsonl, os.path.join(job_config.job.dump_folder,
                                                                                         run_record.METRICS_FILE)))
        self.parallel_dims = parallel_dims
        self.job_config = job_config
        self.device_memory_monitor = build_device_memory_monitor()
        self.color = utils.NoColor() if job_config.metrics.disable_color_printing else utils.Color()
        self.gpu_peak_flops = device.peak_flops()
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()
        self.num_flops_per_token = -1
        self.model_flops = None  # flame.models.flops.ModelFlops, set by the trainer
        self.flops_since_last_log = 0.0
        self.optimizers = self.lr_schedulers = self.model_parts = None
        self.total_steps = job_config.training.steps
        self.step_last_log: int | None = None  # set by the trainer at its first step
        self.time_start = time.perf_counter()
        # the memory plan's estimate, logged beside the measured peak of the first logged step after step 1
        self.planned_gib: float | None = None

    def should_log(self, step: int) -> bool:
        """torchtitan's steps (1 and every log_freq), and the run's last step: its loss, the curves and the run's
        summary end where the training ended, not at the last multiple of log_freq before it."""
        return super().should_log(step) or step == self.total_steps

    def describe_mfu(self) -> str:
        peak = f"{self.gpu_peak_flops / 1e12:.0f} TFLOP/s bf16 dense peak" if self.gpu_peak_flops else "no peak on CPU"
        return (
            f"FLOPs = {self.model_flops.describe()} ({self.num_flops_per_token:,}/token at full context_len); "
            f"MFU = FLOPs/s/device / ({peak}); loss = mean over the steps since the last log line"
        )

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = extra_metrics or {}
        now = time.perf_counter()
        window = now - self.time_last_log
        steps = max(1, step - self.step_last_log)
        tps = self.ntokens_since_last_log / (window * self.parallel_dims.non_data_parallel_size)
        flops_per_second = self.flops_since_last_log / (window * self.parallel_dims.non_data_parallel_size)
        tflops = flops_per_second / 1e12
        mfu = 100 * flops_per_second / self.gpu_peak_flops if self.gpu_peak_flops else None
        memory = self.device_memory_monitor.get_peak_stats()
        data_time = sum(self.data_loading_times)
        eta = (self.total_steps - step) * window / steps
        metrics = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "time_metrics/end_to_end(s)": window / steps,
            "time_metrics/data_loading(%)": 100 * data_time / window,
            "time_metrics/elapsed(s)": now - self.time_start,
            "memory/max_active(GiB)": memory.max_active_gib,
            "memory/max_reserved(GiB)": memory.max_reserved_gib,
            "memory/max_reserved(%)": memory.max_reserved_pct,
            **extra,
        }
        if mfu is not None:
            metrics["mfu(%)"] = mfu
        self.logger.log(metrics, step)

        c = self.color
        skipped = extra.get("skipped_steps", 0)
        spikes = extra.get("spike_skips", 0)
        source_tokens = {k[5:-7]: v for k, v in extra.items() if k.startswith("data/") and k.endswith("/tokens")}
        total = sum(source_tokens.values())
        mix = ""
        if len(source_tokens) > 1 and total:
            mix = "  mix " + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in source_tokens.items())
        if "moe/load_max" in extra:  # the most and least loaded expert of any MoE layer, as multiples of an even share
            mix += f"  experts x{extra['moe/load_max']:.2f}/x{extra['moe/load_min']:.2f}"
        logger.info(
            f"{c.red}step {step:>{len(str(self.total_steps))}}/{self.total_steps}  "
            f"{c.green}loss {global_avg_loss:7.4f}  "
            f"{c.orange}grad_norm {grad_norm:6.3f}  "
            f"{c.yellow}lr {extra.get('lr', float('nan')):.2e}  "
            f"{c.blue}tok/s/device {round(tps):,}  "
            f"{c.cyan}TFLOPS {tflops:.2f}  "
            f"{'' if mfu is None else f'{c.magenta}MFU {mfu:.1f}%  '}"  # none on a CPU, or a GPU of unknown peak
            f"{c.turquoise}mem {memory.max_reserved_gib:.2f}GiB ({memory.max_reserved_pct:.0f}%)  "
            f"{c.white}elapsed {_clock(now - self.time_start)}  ETA {_clock(eta)}"
            f"{f'  skipped {skipped}' if skipped else ''}{f' ({spikes} spikes)' if spikes else ''}{mix}{c.reset}"
        )
        # once: how far the plan's estimate is from what the GPU really took, after step 1, whose
        # backward peak comes before AdamW's moments exist (they are made by its first update)
        if self.planned_gib is not None and (step > 1 or step == self.total_steps):
            logger.info(f"memory: measured peak {memory.max_reserved_gib:.2f} GiB reserved, planned {self.planned_gib:.2f} GiB")
            self.planned_gib = None
        self.ntokens_since_last_log = 0
        self.flops_since_last_log = 0.0
        self.data_loading_times.clear()
        self.time_last_log = now
        self.step_last_log = step
        self.device_memory_monitor.reset_peak_stats()


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """torchtitan TrainSpec hook."""
    return FlameMetricsProcessor(job_config, parallel_dims, tag)


class LossTermsWindow:
    """The parts of the loss beside the cross entropy, over the steps since the last log line, kept on the device (no
    sync a step): the z-loss (--training.z_loss, flame.models.loss) and a MoE model's load-balancing loss with its
    routers' load (flame.models.moe)."""

    def __init__(self, z_loss: bool) -> None:
        self.z_loss = z_loss
        self.z: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, global_valid_tokens: torch.Tensor, on: torch.device) -> torch.Tensor | None:
        """The step's terms, per target like its loss (a pipeline stage without the head has none); returns the step's
        routers' load on this rank, (MoE layers, experts), if any."""
        z_sum = loss.take_z_sum()
        counts, aux_sum = moe.take_router_load()
        if self.z_loss:
            self.z = _summed(self.z, z_sum / global_valid_tokens if z_sum is not None else torch.zeros((), device=on))
        if counts is not None:
            self.counts = _summed(self.counts, counts)
        if aux_sum is not None:
            self.aux = _summed(self.aux, aux_sum / global_valid_tokens)
        return counts

    def metrics(self, reduce, steps: int, batch_group) -> dict[str, float]:
        """``loss_metrics/z_loss`` and ``loss_metrics/router_aux_loss`` (means over the window, reduced as the loss is:
        ``reduce``, the trainer's) and the routers' load (flame.models.moe.load_metrics) over the data-parallel ranks
        (``batch_group``; None: one)."""
        found = {}
        if self.z is not None:
            found["loss_metrics/z_loss"] = reduce(self.z / steps)[1].item()
        if self.aux is not None:
            found["loss_metrics/router_aux_loss"] = reduce(self.aux / steps)[1].item()
        if self.counts is not None:
            if batch_group is not None:
                dist.all_reduce(self.counts, group=batch_group)
            found |= moe.load_metrics(self.counts)
        self.z = self.aux = self.counts = None
        return found


def _summed(total: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if total is None else total + more


def data_metrics(loader, parallel_dims, on: torch.device) -> dict[str, float]:
    """The counters each source's format logs (flame.data.formats), over all ranks, since the run started:
    documents and tokens trained on; for SFT sources also the conversations dropped or truncated as too
    long and the padding before them."""
    counts = torch.tensor(np.stack(list(loader.counts.values())), device=on)
    if parallel_dims.dp_enabled:
        torch.distributed.all_reduce(counts, group=parallel_dims.get_mesh("batch").get_group())
    metrics = {}
    plan = loader.dataset.plan
    for name, record, source_counts in zip(plan.source_names(), plan.formats, counts.T.tolist()):
        for counter, count in zip(loader.counts, source_counts):
            if counter in record.counters:
                metrics[f"data/{name}/{counter}"] = count
    return metrics

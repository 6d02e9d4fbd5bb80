"""flame's GPU checks: one driver whose suites are data (SUITES below).

    python scripts/gpu_check.py --list                      the suites and what each runs
    python scripts/gpu_check.py --suite zoo --out $OUT      one suite (--suite may repeat)
    python scripts/gpu_check.py --suite tp --configs configs/tiny/llama.json --dry-run
    python scripts/gpu_check.py --suite peers --out $OUT --budget 560   flame vs torchtitan's own trainer vs
        the plain loop, 340M (1B: --configs configs/llama_1B.json configs/transformer_1B.json --tokens 16384)
    python scripts/gpu_check.py --suite scaling --spread --out $OUT      FSDP weak scaling on 4 GPUs, the
        one-GPU runs side by side (--spread: one per visible GPU, then the 4-GPU runs)

Every step's log (and a train.sh run's metrics.jsonl) goes to <work>/<suite>/, which is packed
into <out>/<suite>.tgz after every step, so a command stopped at its limit still returns what
finished; the machine's kernel caches go to <out> too (scripts/bench/runs.py). Last, a short
summary per suite, also written to <out>/summary.txt. Run it from any directory; it runs its
steps from the repository root, and `bash train.sh` with the interpreter that runs it.

On a GPU machine without network, install the carried wheels first, in the same command:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD && python3 scripts/gpu_check.py --suite default --out $OUT --budget 560

The gated delta-rule family needs TileLang on Hopper: carry .gpu-extra/ as well
(scripts/bench/tilelang_bundle.sh makes it) and add `tar xJf .gpu-extra/tilelang.tar.xz -C /tmp/site`
after the pip line. mamba2 trains on mamba_ssm's SSD kernel, which 3rdparty/install.sh builds
without CUDA; put its wheel beside the others once (`MAMBA_SKIP_CUDA_BUILD=TRUE
MAMBA_FORCE_BUILD=TRUE pip wheel --no-build-isolation --no-deps mamba-ssm==2.3.2.post1 -w .whl`).
Carry .kernel-cache/ to start with earlier machines' autotune choices.
"""

import argparse
import os
import queue
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # flame and scripts.bench, however the driver is started

import torch  # noqa: E402

from flame.data import builtin  # noqa: E402
from scripts.bench import reports, runs  # noqa: E402
from scripts.bench.plan import (  # noqa: E402
    COMPILE_FLAG,
    Command,
    Run,
    Step,
    Suite,
    placeholders,
    rounds_of,
    steps_of,
)

DEBUG_JOB = ("--job.config_file", "configs/debug.toml")
NO_CHECKPOINT = ("--checkpoint.no-enable",)
FP32 = ("--training.mixed_precision_param", "float32")  # fp32 on both sides: curves agree to rounding
TP2 = ("--parallelism.tensor_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
ROW = ("--training.varlen", "--training.batch_size", "1", "--training.seq_len", "{tokens}")  # one varlen row
ROWS4 = ("--training.batch_size", "4", "--training.seq_len", "{quarter}")  # the same tokens in 4 rows
# 4 rows of 8K tokens, one causal context each: rows the memory plan may split into micro-batches
ROWS4_8K = ("--training.no-varlen", "--training.batch_size", "4", "--training.seq_len", "8192", "--training.context_len",
            "8192")
# one causal sequence of 2 x tokens: documents concatenated without a mask, full AC so that 1 GPU fits it
LONG = ("--training.batch_size", "1", "--training.seq_len", "{double}", "--training.context_len", "{double}",
        "--training.no-document_mask", "--activation_checkpoint.mode", "full", "--training.steps", "8")
CONTEXT = 4096  # longest document piece of the 340M runs ({context}; a quarter of --tokens when that is less)
PYTEST = ("{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider")
# the peers suite: every side runs {steps} steps and is timed over the last half (its last logged window)
PEER = ("{python}", "-m", "scripts.bench.torchtitan_peer", "--config", "{config}", "--tokens", "{tokens}", "--steps",
        "{steps}", "--log-freq", "{half}", "--device", "{device}")
PLAIN = ("{python}", "-m", "scripts.bench.plain_loop", "--config", "{config}", "--seq", "{tokens}", "--context",
         "{context}", "--warmup", "{half}", "--steps", "{half}", "--device", "{device}")
# the flame side of the peers and scaling suites: the peers' data, shapes, schedule and timed window
PEER_JOB = (*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}", "--metrics.log_freq",
            "{half}", "--lr_scheduler.warmup_steps", "{half}", "--optimizer.lr", "3e-4", "--training.num_workers", "4",
            *NO_CHECKPOINT)
# configs torchtitan's llama3 runs for; an fla transformer's row reads the llama run of its size (equal parameters)
TORCHTITAN_TWINS = ("llama_340M", "llama_1B")


# the memory suite's estimates against measured peaks: each family issue 24 names, at 340M and 1B
ESTIMATED = ("transformer_340M", "gla_340M", "gated_deltanet_340M", "transformer_1B", "gla_1B", "gated_deltanet_1B")


def tiny(*names: str) -> tuple[str, ...]:
    return tuple(f"configs/tiny/{name}.json" for name in names)


SUITES = {
    "default": Suite(
        "the embedded default job (`bash train.sh`) and tests/gpu (2-GPU runs when 2 GPUs are visible)",
        report="lines",
        setup=(
            Command("default_job", ("bash", "train.sh"), show=r"step +(1|100|200|300)/300",
                    show_block="^sample from"),
            Command("gpu_tests", (*PYTEST, "tests/gpu")),
        ),
        timeout=400,
    ),
    "zoo": Suite(
        "every model type (configs/tiny) on flame's model path: varlen parity, eager and compiled training, "
        "activation checkpointing; --jobs processes share the GPU, so tokens/s is indicative",
        report="zoo",
        per_config=(Command("zoo", ("{python}", "-m", "scripts.bench.model_zoo", "{config}", "--steps", "{steps}",
                                    "--tokens", "{tokens}", "--device", "{device}"), no_compile=("--no-compile",)),),
        configs=tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "tiny").glob("*.json"))),
        steps=30, tokens=8192, timeout=400, parallel=True,
    ),
    "throughput": Suite(
        "one GPU: flame's trainer against a plain PyTorch loop, same model and data (varlen rows, context 4096)",
        report="throughput",
        per_config=(
            Command("plain", ("{python}", "-m", "scripts.bench.plain_loop", "--config", "{config}", "--seq", "{tokens}",
                              "--context", "{context}", "--steps", "{steps}", "--device", "{device}")),
            Run("flame", 1, ("--training.steps", "{steps}", "--metrics.log_freq", "10")),
        ),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--lr_scheduler.warmup_steps", "10",
               "--optimizer.lr", "3e-4", "--training.num_workers", "4", *NO_CHECKPOINT),
        configs=("configs/transformer_340M.json", "configs/gla_340M.json"),
        steps=30, tokens=65536, timeout=280,
    ),
    "peers": Suite(
        "one GPU: flame against torchtitan's own llama3 trainer at the same sizes (its varlen attention, "
        "block-causal masks) and the plain PyTorch loop, on the builtin corpus in one varlen row per step, eager "
        "and compiled, and flame compiled with FP8 (llama; against torchtitan compiled); 1B: --configs "
        "configs/llama_1B.json configs/transformer_1B.json --tokens 16384; "
        "plain-compiled runs on request (--only)",
        report="peers",
        per_config=(
            Command("torchtitan", PEER, only=TORCHTITAN_TWINS),
            Command("torchtitan-compiled", (*PEER, "--compile"), only=TORCHTITAN_TWINS, compiled=True),
            Run("flame", 1),
            Run("flame-compiled", 1, (COMPILE_FLAG,)),
            # FP8 linear layers where this GPU runs them faster (flame.models.float8), against torchtitan's compiled bf16
            Run("flame-fp8", 1, (COMPILE_FLAG, "--float8.recipe_name", "tensorwise"), only=TORCHTITAN_TWINS),
            Command("plain", PLAIN),
            Command("plain-compiled", (*PLAIN, "--compile"), compiled=True, on_request=True),
        ),
        flags=PEER_JOB,
        configs=("configs/llama_340M.json", "configs/transformer_340M.json"),
        steps=20, tokens=32768, timeout=300,
    ),
    "scaling": Suite(
        "FSDP weak scaling: flame and torchtitan's own llama3 trainer (the peers suite's method), compiled, on one GPU "
        "and on 4, one varlen row of --tokens per GPU: tokens/s per GPU, the share of the one-GPU rate each keeps on "
        "4, and flame/torchtitan at each size (--spread runs the one-GPU runs side by side)",
        report="scaling",
        per_config=(
            Command("torchtitan-1", (*PEER, "--compile"), only=TORCHTITAN_TWINS),
            Command("torchtitan-4", (*PEER, "--compile", "--gpus", "4"), only=TORCHTITAN_TWINS, gpus=4),
            Run("flame-1", 1, (COMPILE_FLAG,)),
            Run("flame-4", 4, (COMPILE_FLAG,)),
        ),
        flags=PEER_JOB,
        configs=("configs/llama_340M.json", "configs/llama_1B.json"),
        steps=20, tokens=32768, timeout=300,
    ),
    "layouts": Suite(
        "one model's multi-GPU layouts from one seed against their references, and weak scaling against "
        "fsdp1 (up to 4 GPUs; layouts that need more than are visible are skipped)",
        report="runs",
        per_config=(
            Run("fsdp1", 1, ROW),
            Run("fsdp2", 2, ROW),
            Run("fsdp4", 4, ROW),
            Run("tp2", 4, (*ROW, *TP2), reference="fsdp2"),  # TP 2 x FSDP 2 on fsdp2's rows
            Run("rows2", 2, ROWS4),
            Run("pp2", 4, (*ROWS4, *PP2), reference="rows2"),  # PP 2 x FSDP 2, 4 microbatches
            Run("rows1", 1, (*ROWS4, *FP32)),
            # PP 2 x TP 2 without FSDP: torchtitan applies no mixed precision, so fp32 and a fp32 reference
            Run("pptp", 4, (*ROWS4, *FP32, *PP2, *TP2), reference="rows1"),
            Run("cp2", 2, (*ROW, *CP2), reference="fsdp1"),  # fsdp1's row split over 2 GPUs
            Run("long1", 1, LONG),
            Run("cp2long", 2, (*LONG, *CP2), reference="long1"),
        ),
        flags=(*DEBUG_JOB, "--training.context_len", "{context}", "--training.seq_len", "{tokens}", "--training.steps",
               "{steps}", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", *NO_CHECKPOINT),
        configs=("configs/transformer_340M.json",),
        steps=20, tokens=65536, timeout=240, seeded=True, baseline="fsdp1",
    ),
    "tp": Suite(
        "tensor parallelism: TP 2 against 1 GPU in fp32 with fla's kernels, the fused loss and async TP "
        "(not delta_net or gated_deltaproduct: their kernels refuse fp32)",
        report="runs",
        per_config=(
            Run("1gpu", 1),
            Run("tp2", 2, TP2, reference="1gpu"),
            Run("tp2-fused", 2, (*TP2, "--training.fused_cross_entropy", "on"), reference="1gpu", only=("llama", "gla")),
            Run("tp2-async", 2, (*TP2, COMPILE_FLAG, "--parallelism.enable_async_tensor_parallel"), reference="1gpu",
                only=("llama",)),
        ),
        flags=(*DEBUG_JOB, "--training.steps", "{steps}", "--training.seq_len", "{tokens}", "--metrics.log_freq", "1",
               *NO_CHECKPOINT, "--lr_scheduler.warmup_steps", "2", *FP32),
        configs=tiny("transformer", "gla", "gsa", "mamba2", "llama"),
        steps=10, tokens=256, timeout=500, seeded=True,
    ),
    "cp": Suite(
        "context parallelism: the CP kernel tests, then CP 2 against 1 GPU on one long varlen row, head-tail "
        "and contiguous, fp32 (FlexAttention); llama also bf16 (varlen kernel)",
        report="runs",
        setup=(Command("kernel_tests", (*PYTEST, "tests/gpu/test_context_parallel_kernels.py")),),
        per_config=(
            Run("1gpu", 1, FP32),
            Run("cp2", 2, (*FP32, *CP2), reference="1gpu"),
            Run("cp2contiguous", 2, (*FP32, *CP2, "--parallelism.context_parallel_load_balancer", "None"),
                reference="1gpu"),
            Run("1gpu_bf16", 1, only=("llama",)),
            Run("cp2_bf16", 2, CP2, reference="1gpu_bf16", only=("llama",)),
        ),
        flags=(*DEBUG_JOB, "--training.steps", "{steps}", "--metrics.log_freq", "1", *NO_CHECKPOINT,
               "--lr_scheduler.warmup_steps", "2", "--training.varlen", "--training.batch_size", "1",
               "--training.seq_len", "{tokens}"),
        configs=tiny("llama", "transformer", "kda"),
        steps=10, tokens=32768, timeout=500, seeded=True,
    ),
    "muon": Suite(
        "one GPU: AdamW against Muon (--optimizer.name Muon, AdamW on embeddings, head and norms) from the same "
        "initial weights (one GPU draws them alike from the seed) on the same tokens: loss curves side by side, "
        "Muon's step-time overhead, the step where Muon reaches AdamW's last loss",
        report="curves",
        per_config=(
            Run("adamw", 1, ("--optimizer.lr", "1e-3")),
            # match_rms_adamw scales Muon's updates to AdamW's RMS: the same lr for both groups
            Run("muon", 1, ("--optimizer.name", "Muon", "--optimizer.lr", "1e-3")),
        ),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "10", "--lr_scheduler.warmup_steps", "20", "--training.num_workers", "4",
               *NO_CHECKPOINT),
        configs=("configs/transformer_340M.json",),
        steps=120, tokens=65536, timeout=240, baseline="adamw",
    ),
    "lora": Suite(
        "LoRA (rank 16 on every linear layer) against full training on one GPU, both from one seed checkpoint as "
        "the base: tokens/s, MFU and peak memory (1B); and a tiny fla model with adapters, whose first step checks "
        "that every adapter gets a gradient",
        report="runs",
        per_config=(
            Run("full", 1, only=("transformer_1B",)),
            Run("lora", 1, ("--lora.rank", "16", "--lora.alpha", "32")),
        ),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", *NO_CHECKPOINT),
        configs=("configs/transformer_1B.json", "configs/tiny/gla.json"),
        steps=20, tokens=16384, timeout=400, seeded=True, baseline="full",
    ),
    "sft": Suite(
        "one GPU: supervised fine-tuning, 340M, on the shipped chat sample (assistant-only targets, one "
        "conversation per document) mixed half and half with the builtin text corpus: the loss falls, tokens/s, "
        "MFU and peak memory",
        report="runs",
        per_config=(Run("sft", 1),),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--training.dataset", "tests/data/chat.jsonl,builtin:python-stdlib", "--training.data_format",
               "sft,text", "--training.data_probs", "0.5,0.5", "--metrics.log_freq", "5",
               "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4", "--training.num_workers", "4",
               *NO_CHECKPOINT),
        configs=("configs/transformer_340M.json",),
        steps=60, tokens=16384, timeout=240,
    ),
    "ssm": Suite(
        "one GPU: the Mamba-family kernel tests (tests/gpu/test_mamba2_gpu.py; on request the selective scan's and "
        "the exports'), then 340M mamba2 (fla's Triton conv, mamba_ssm's SSD scan, documents isolated), samba and "
        "gla on one varlen row per step: the loss falls, tokens/s, MFU and peak memory; mamba2 and samba also with "
        "full activation checkpointing, mamba2 with every second block checkpointed, with op-level AC and under a "
        "40 GiB memory budget",
        report="runs",
        setup=(Command("mamba2_tests", (*PYTEST, "-s", "tests/gpu/test_mamba2_gpu.py")),  # -s: the 340M test's phase times
               Command("scan_tests", (*PYTEST, "tests/gpu/test_mamba_scan_gpu.py"), on_request=True),
               Command("export_tests", (*PYTEST, "tests/gpu/test_exports.py", "-k", "mamba"), on_request=True)),
        per_config=(Run("train", 1),
                    Run("train_budget40", 1, ("--memory.gpu_budget_gib", "40"), only=("mamba2_340M",)),
                    Run("train_ac2", 1, ("--activation_checkpoint.mode", "selective",
                                         "--activation_checkpoint.selective_ac_option", "2"), only=("mamba2_340M",)),
                    Run("train_op", 1, ("--activation_checkpoint.mode", "selective",
                                        "--activation_checkpoint.selective_ac_option", "op"), only=("mamba2_340M",)),
                    # no compiled runs: both types' blocks stay eager under --training.compile (flame.models.support)
                    Run("train_ac", 1, ("--activation_checkpoint.mode", "full"), only=("mamba2_340M", "samba_340M"))),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "5", "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", *NO_CHECKPOINT),
        configs=("configs/mamba2_340M.json", "configs/gla_340M.json", "configs/samba_340M.json"),
        steps=30, tokens=32768, timeout=400,
    ),
    "memory": Suite(
        "one GPU, --memory.plan auto: the plan's estimate beside the measured peak for each activation checkpointing "
        "plan (none, op-level selective, full) at 340M and 1B; then the budgets: 1B under --memory.gpu_budget_gib 24 "
        "against its unconstrained run (and under 16 on each of 2 GPUs, FSDP), 340M at 64K tokens under 16, and "
        "transformer_7B with no memory flag "
        "(it takes the optimizer on the host) at 256K tokens a step; each run prints the plan it chose. The plan's prices against "
        "measured speed: this machine's rates, then llama 340M's 4 rows of 8K under each layout by hand and under a "
        "30 GiB budget",
        report="runs",
        setup=(Command("hardware", ("{python}", "-m", "flame.memory.hardware"), show=r"matmul|measured in"),
               # the probe's fit of a block against the block as it runs, at rows up to 8x the probe's longest
               Command("probe_backward", ("{python}", "scripts/bench/probe_backward.py", "transformer_7B",
                                          *ESTIMATED[3:], "transformer_340M"), show=r"tokens:|blocks,",
                       on_request=True)),
        per_config=(
            Run("none", 1, ("--activation_checkpoint.mode", "none"), only=ESTIMATED),
            Run("op", 1, ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                          "op"), only=ESTIMATED),
            Run("full", 1, ("--activation_checkpoint.mode", "full"), only=ESTIMATED),
            Run("budget24", 1, ("--memory.gpu_budget_gib", "24"), only=("transformer_1B",)),
            # FSDP over 2 GPUs: the weights, gradients and state halve on each rank, the activations do not
            Run("fsdp2_budget16", 2, ("--memory.gpu_budget_gib", "16"), only=("transformer_1B",)),
            Run("budget16_64k", 1, ("--memory.gpu_budget_gib", "16", "--training.seq_len", "65536"),
                only=("transformer_340M",)),
            # the plan's prices and estimates against measured speed and peaks: 4 rows of 8K, each layout given (the plan
            # keeps it and logs its estimate), then the plan's own choice
            *(Run(f"rows_{name}", 1, (*ROWS4_8K, *flags), only=("llama_340M",)) for name, flags in (
                ("none", ()),
                ("full", ("--activation_checkpoint.mode", "full")),
                ("op", ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")),
                ("mb2", ("--training.batch_size", "2", "--training.gradient_accumulation_steps", "2")),
                ("mb4", ("--training.batch_size", "1", "--training.gradient_accumulation_steps", "4")))),
            Run("rows_budget30", 1, (*ROWS4_8K, "--memory.gpu_budget_gib", "30"), only=("llama_340M",)),
            # 8 rows of 32K (256K tokens a step; varlen takes one row), which the plan may split into micro-batches.
            # 8 steps at a rate well below a 7B's usual peak: at 1e-4 and 3e-4 the loss rose at steps 3-4, at 3e-5
            # it falls (11.2 to 8.1 over these steps on an H200; docs/perf-log.md, 2026-11-28)
            Run("alone", 1, ("--training.no-varlen", "--training.batch_size", "8", "--training.steps", "8",
                             "--metrics.log_freq", "1", "--optimizer.lr", "3e-5"),
                only=("transformer_7B",)),
            # issue 56's budgets: the plan's choice at 32 and 24 GiB (weight streaming and parked inputs offered),
            # against FSDP2's own CPU offload given
            Run("budget32", 1, ("--memory.gpu_budget_gib", "32"), only=("transformer_7B",)),
            Run("budget24_7B", 1, ("--memory.gpu_budget_gib", "24"), only=("transformer_7B",)),
            Run("offload32", 1, ("--memory.gpu_budget_gib", "32", "--training.enable_cpu_offload",
                                 "--optimizer.no-on_host"), only=("transformer_7B",)),
        ),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "2", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", "--memory.plan", "auto", *NO_CHECKPOINT),
        configs=(*(f"configs/{name}.json" for name in ESTIMATED), "configs/transformer_7B.json",
                 "configs/llama_340M.json"),
        steps=10, tokens=32768, timeout=500, baseline="none",
    ),
    "streaming": Suite(
        "issue 56, one GPU, --memory.plan auto: transformer_7B unconstrained and under 32 GiB at 32K, 64K and 128K "
        "tokens a step and under 24 GiB (the plan streams the weights where nothing else fits; each run prints the "
        "plan, its estimate and the measured peak); LoRA rank 16 on llama_27B, held and streamed",
        report="runs",
        per_config=(
            Run("unconstrained", 1, only=("transformer_7B",)),
            Run("budget32", 1, ("--memory.gpu_budget_gib", "32"), only=("transformer_7B",)),
            Run("budget32_64k", 1, ("--memory.gpu_budget_gib", "32", "--training.seq_len", "65536"),
                only=("transformer_7B",)),
            Run("budget32_128k", 1, ("--memory.gpu_budget_gib", "32", "--training.seq_len", "131072"),
                only=("transformer_7B",)),
            Run("budget24", 1, ("--memory.gpu_budget_gib", "24"), only=("transformer_7B",)),
            Run("lora", 1, ("--lora.rank", "16", "--lora.alpha", "32"), only=("llama_27B",)),
            Run("lora_streamed", 1, ("--lora.rank", "16", "--lora.alpha", "32", "--memory.stream_weights"),
                only=("llama_27B",)),
        ),
        # 7B and 27B at a rate their first steps take without rising (docs/perf-log.md, 2026-11-28)
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-5",
               "--training.num_workers", "4", "--memory.plan", "auto", *NO_CHECKPOINT),
        configs=("configs/transformer_7B.json", "configs/llama_27B.json"),
        steps=10, tokens=32768, timeout=500, baseline="unconstrained",
    ),
    "streaming_parity": Suite(
        "the weights streamed against held, from one seed checkpoint: llama_340M on one GPU, and over 2 GPUs each "
        "streaming its shards against FSDP (skipped on one GPU): the loss curves within bf16 noise, tokens/s, MFU "
        "and peak memory",
        report="runs",
        per_config=(
            Run("held", 1),
            Run("streamed", 1, ("--memory.stream_weights",), reference="held"),
            Run("fsdp2", 2),
            Run("sharded2", 2, ("--memory.stream_weights",), reference="fsdp2"),
        ),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", *NO_CHECKPOINT),
        configs=("configs/llama_340M.json",),
        steps=20, tokens=32768, timeout=300, seeded=True, baseline="held",
    ),
    "profile": Suite(
        "one GPU: where flame's training step spends its time, eager and compiled, and the plain PyTorch loop's on "
        "the same model and data: the last of --steps steps under torch's profiler, its GPU kernels summed by kind "
        "and the time the GPU waited on the host (scripts/bench/trace_summary.py); the same job as the peers suite, "
        "without its timing (the profiler slows the step it records). --only host_waits: the Python lines of step "
        "5's synchronizing calls instead (scripts/bench/host_waits.py)",
        report="profiles",
        per_config=(Run("eager", 1), Run("compiled", 1, (COMPILE_FLAG,)),
                    Command("plain", ("{python}", "-m", "scripts.bench.plain_loop", "--config", "{config}", "--seq",
                                      "{tokens}", "--context", "{context}", "--warmup", "{half}", "--steps", "{half}",
                                      "--device", "{device}", "--profile", "{profile}")),
                    Command("host_waits", ("{python}", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                           "1", "-m", "scripts.bench.host_waits", *DEBUG_JOB, *ROW,
                                           "--training.context_len", "{context}", "--training.steps", "6",
                                           "--training.num_workers", "4", *NO_CHECKPOINT, "--model.config", "{config}"),
                            show=r"synchronizing call|^ +\d+x ", on_request=True)),
        flags=(*DEBUG_JOB, *ROW, "--training.context_len", "{context}", "--training.steps", "{steps}",
               "--metrics.log_freq", "{half}", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-4",
               "--training.num_workers", "4", *NO_CHECKPOINT, "--profiling.enable_profiling",
               "--profiling.profile_freq", "{steps}"),
        configs=("configs/transformer_340M.json", "configs/llama_340M.json", "configs/gla_340M.json"),
        steps=10, tokens=32768, timeout=300,
    ),
    "loader": Suite(
        "flame.data's loader throughput on this machine's CPUs (0-16 workers, rows of --tokens)",
        report="lines",
        setup=(Command("loader_bench", ("{python}", "-m", "flame.tools.loader_bench", "--workers", "0,1,4,8,16", "--batches",
                                        "300", "--", *DEBUG_JOB, "--training.seq_len", "{tokens}",
                                        "--training.batch_size", "8"), show=r"^ *(workers|\d+) "),),
        tokens=4096, timeout=300,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="flame's GPU checks: suites of training runs and benchmarks.",
                                     epilog="suites: " + ", ".join(SUITES) + " (--list shows what each runs)")
    parser.add_argument("--suite", action="append", choices=SUITES, help="a suite to run (repeatable, in order)")
    parser.add_argument("--list", action="store_true", help="print the suites and their steps")
    parser.add_argument("--merge-cache", type=Path, metavar="FOLDER",
                        help="merge the kernel caches a device command returned into .kernel-cache/, and exit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/flame-gpu/out"),
                        help="what comes back: <suite>.tgz, kernel caches, summary.txt (default: $OUT)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flame-gpu"), help="logs and metrics, per suite")
    parser.add_argument("--configs", nargs="+", metavar="JSON", help="model configs instead of the suite's")
    parser.add_argument("--only", nargs="+", metavar="ITEM", help="only these items of the suites (e.g. long1 cp2long)")
    parser.add_argument("--steps", type=int, help="training steps per run, instead of the suite's")
    parser.add_argument("--tokens", type=int, help="tokens per row (per data-parallel rank), instead of the suite's")
    parser.add_argument("--flags", default="", metavar="FLAGS",
                        help="more train.sh flags for every run, e.g. --flags='--training.mixed_precision_param float32'")
    parser.add_argument("--no-compile", action="store_true", help="skip compiled runs and zoo stages")
    parser.add_argument("--jobs", type=int, help="zoo processes sharing the GPU (default 4)")
    parser.add_argument("--spread", action="store_true",
                        help="run one-GPU steps side by side, one per visible GPU, before the steps that need more: "
                             "peaks and losses hold, tokens/s is shared with the other runs' host work")
    parser.add_argument("--repeat", type=int,
                        help="scaling: run every step this many times, in rounds (named <step>-run<k>); the table gives "
                             "each side's median and range. A 4-GPU run's share varies from run to run (78-93%% of one "
                             "GPU's in seven runs of one 340M job)")
    parser.add_argument("--timeout", type=int, help="seconds per step, instead of the suite's")
    parser.add_argument("--budget", type=int, help="seconds for the whole check: steps are cut to fit, later ones skipped")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU (gloo processes for GPUs), to check the driver on a machine without one")
    parser.add_argument("--dry-run", action="store_true", help="print the steps' commands and exit")
    args = parser.parse_args(argv)
    check(parser, args)
    return args


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before anything runs, options that would do nothing or cannot work."""
    if args.merge_cache and not args.merge_cache.is_dir():
        parser.error(f"--merge-cache {args.merge_cache} is not a folder (give a device command's files_at folder)")
    if args.merge_cache or args.list:
        return
    if not args.suite:
        parser.error("choose a suite: --suite NAME (--list shows them)")
    suites = [SUITES[name] for name in args.suite]
    for value, name in ((args.steps, "--steps"), (args.tokens, "--tokens"), (args.jobs, "--jobs"),
                        (args.timeout, "--timeout"), (args.budget, "--budget"), (args.repeat, "--repeat")):
        if value is not None and value <= 0:
            parser.error(f"{name} must be positive, got {value}")
    used = set().union(*(placeholders(suite) for suite in suites))
    unused = {"--configs": args.configs and not any(suite.per_config for suite in suites),
              "--steps": args.steps and not used & {"steps", "half"},
              "--tokens": args.tokens and not used & {"tokens", "quarter", "double", "context"},
              "--flags": args.flags and not any(isinstance(i, Run) for s in suites for i in s.per_config),
              "--jobs": args.jobs and not any(suite.parallel for suite in suites),
              "--spread": args.spread and all(suite.parallel for suite in suites),
              "--no-compile": args.no_compile and not any(compiles(suite) for suite in suites)}
    for option, is_unused in unused.items():
        if is_unused:
            parser.error(f"{option} means nothing to suite {', '.join(args.suite)}; leave it out")
    if args.repeat and (single := [name for name in args.suite if SUITES[name].report != "scaling"]):
        parser.error(f"--repeat: suite {', '.join(single)} reports each run by itself; only the scaling suite's table "
                     "takes the median of repeated runs")
    if args.spread and (seeded := [name for name in args.suite if SUITES[name].seeded]):
        parser.error(f"--spread: suite {', '.join(seeded)} starts every run of a config from one seed checkpoint, "
                     "made by the first; run it without --spread")
    missing = [config for config in args.configs or () if not (ROOT / config).is_file()]
    if missing:
        parser.error(f"--configs: {', '.join(missing)} not found (paths relative to the repository root)")
    items = {item.name for suite in suites for item in (*suite.setup, *suite.per_config)}
    if unknown := set(args.only or ()) - items:
        parser.error(f"--only {' '.join(sorted(unknown))}: not an item of {', '.join(args.suite)}; "
                     f"choose from {' '.join(sorted(items))}")


def compiles(suite: Suite) -> bool:
    return any(isinstance(i, Command) and (i.no_compile or i.compiled) or isinstance(i, Run) and COMPILE_FLAG in i.flags
               for i in (*suite.setup, *suite.per_config))


def plan(name: str, args: argparse.Namespace) -> list[Step]:
    suite = SUITES[name]
    tokens = args.tokens or suite.tokens or 0
    steps = args.steps or suite.steps or 0
    values = {"steps": steps, "half": max(1, steps // 2), "tokens": tokens, "quarter": tokens // 4, "double": 2 * tokens,
              "context": min(CONTEXT, tokens // 4), "device": "cpu" if args.cpu else "cuda", "python": sys.executable,
              "work": str((args.work / name).resolve())}  # commands run from the repository root
    configs = list(args.configs or suite.configs)
    steps = steps_of(name, suite, configs, values, shlex.split(args.flags), set(args.only or ()), args.no_compile)
    return rounds_of(steps, args.repeat or 1)


def list_suites() -> None:
    for name, suite in SUITES.items():
        defaults = ", ".join(f"{key} {value}" for key, value in (("steps", suite.steps), ("tokens", suite.tokens),
                                                                   ("timeout", suite.timeout)) if value)
        print(f"{name}: {suite.about}\n  defaults: {defaults}")
        folders = {str(Path(config).parent) for config in suite.configs}
        if len(suite.configs) > 6 and len(folders) == 1:
            print(f"  configs: the {len(suite.configs)} in {folders.pop()}/")
        elif suite.configs:
            print(f"  configs: {' '.join(suite.configs)}")
        if suite.flags:
            print(f"  train.sh flags of every run: {' '.join(suite.flags)}")
        for command in suite.setup:
            print(f"  {command.name}: {' '.join(command.argv)}")
        for item in suite.per_config:
            where = f" (only {', '.join(item.only)})" if item.only else ""
            where += " (on request: --only)" if isinstance(item, Command) and item.on_request else ""
            if isinstance(item, Command):
                print(f"  per config, {item.name}{where}: {' '.join(item.argv)}")
            else:
                vs = f", against {item.reference}" if item.reference else ""
                print(f"  per config, {item.name}{where}: {item.gpus} GPU{'s' * (item.gpus > 1)}{vs}: "
                      f"{' '.join(item.flags) or '(the flags above)'}")


class Budget:
    """The time each step may take: its own limit, cut to what is left of --budget."""

    RESERVE = 20  # seconds kept for packing the last logs and printing the summary

    def __init__(self, seconds: int | None):
        self.end = time.monotonic() + seconds if seconds else None

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic() - self.RESERVE

    def limit(self, own: int) -> float:
        return min(own, self.left())


def run_suite(name: str, steps: list[Step], args: argparse.Namespace, env: dict, budget: Budget, gpus: int) -> list:
    suite = SUITES[name]
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    own_limit = args.timeout or suite.timeout
    lock = threading.Lock()  # parallel steps pack the same archive

    def one(step: Step, device: dict | None = None) -> runs.Result:
        if not args.cpu and step.gpus > gpus:
            result = runs.Result(step, None, note=f"needs {step.gpus} GPUs, {gpus} visible")
        elif budget.left() < 30:
            result = runs.Result(step, None, note="--budget spent")
        else:
            result = runs.run_step(step, work, lambda: budget.limit(own_limit), env | (device or {}))
        with lock:
            runs.pack(work, args.out / f"{name}.tgz")
            if not args.cpu:
                runs.save_kernel_caches(args.out)
            print(f"[{name}] {step.name}: {reports.outcome(result)}", flush=True)
        return result

    if suite.parallel:
        with ThreadPoolExecutor(args.jobs or 4) as pool:
            return list(pool.map(one, steps))
    if args.spread and gpus > 1:
        return spread(steps, one, gpus)
    return [one(step) for step in steps]


def spread(steps: list[Step], one, gpus: int) -> list:
    """--spread: the steps that fit one GPU run side by side, each on a GPU of its own
    (CUDA_VISIBLE_DEVICES), as GPUs come free; then the steps that need more, one at a time on
    all of them. Results keep the suite's order."""
    free = queue.Queue()
    # the GPUs this process sees, by the names its parent gave them (a CUDA_VISIBLE_DEVICES of 1,2 spreads over
    # GPUs 1 and 2, not 0 and 1)
    visible = [name.strip() for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    for name in (visible or [str(index) for index in range(gpus)])[:gpus]:
        free.put(name)

    def on_own_gpu(step: Step):
        device = free.get()
        try:
            return one(step, {"CUDA_VISIBLE_DEVICES": device})
        finally:
            free.put(device)

    single = [step for step in steps if step.gpus == 1]
    with ThreadPoolExecutor(gpus) as pool:
        done = dict(zip(map(id, single), pool.map(on_own_gpu, single)))
    done |= {id(step): one(step) for step in steps if step.gpus > 1}
    return [done[id(step)] for step in steps]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge_cache:
        for line in runs.merge_kernel_caches(args.merge_cache) or ["no autotune.tgz or tlcache.tgz there"]:
            print(f"kernel cache: {line}")
        return 0
    if args.list:
        list_suites()
        return 0
    planned = {name: plan(name, args) for name in args.suite}
    if args.dry_run:
        for name, steps in planned.items():
            for step in steps:
                prefix = f"NGPU={step.gpus} " if step.train else ""
                command = ["bash", "train.sh", *step.common, "--model.config", step.config, *step.argv] if step.train \
                    else step.argv
                seed = " (from the config's seed checkpoint)" if step.seeded else ""
                print(f"[{name}] {step.name}: {prefix}{shlex.join(command)}{seed}")
        return 0
    gpus = torch.cuda.device_count()
    if not gpus and not args.cpu:
        print("gpu_check: error: no CUDA GPU is visible; pass --cpu to check the driver on the CPU", file=sys.stderr)
        return 2
    env = runs.environment(args.cpu)
    os.environ.update(env)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cpu:
        runs.restore_kernel_caches()
    for spec in ("builtin:python-stdlib", "builtin:python-stdlib-bpe"):
        builtin.resolve(spec)  # once here, not by every parallel step
    devices = [torch.cuda.get_device_name(i) for i in range(gpus)] if not args.cpu else ["CPU"]
    print(f"gpu_check: {', '.join(devices)}; torch {torch.__version__}; work {args.work}, out {args.out}", flush=True)
    budget = Budget(args.budget)
    results = {name: run_suite(name, steps, args, env, budget, gpus) for name, steps in planned.items()}
    summary = []
    for name, done in results.items():
        suite = SUITES[name]
        summary += [f"=== {name}: {suite.about} ===",
                    *reports.REPORTS[suite.report](done, args.work / name, suite.baseline)]
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    failed = [r for done in results.values() for r in done if r.status not in (0, None)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

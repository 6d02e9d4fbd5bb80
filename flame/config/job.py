"""flame's configuration: the fields flame adds to torchtitan's JobConfig.

torchtitan's ConfigManager merges these dataclasses into its JobConfig through
``--job.custom_config_module=flame.config.job`` (flame passes that flag itself, see
``flame.config.manager``). A field that exists in torchtitan too is overridden here only to
change its default. The older spellings flame users know from earlier flame (and torchtitan)
versions are fields here too, so that they parse; what each means, and torchtitan's fields
that flame refuses, are in ``flame.config.spellings``.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    dump_folder: str = "exp/flame"
    """Folder for checkpoints, logs, TensorBoard files and the exported HF model"""
    allow_absolute_folders: bool = False
    """Let the folders a run keeps in its dump folder (checkpoint.folder, metrics.save_tb_folder, comm.save_traces_folder, profiling's folders, job.save_config_file) be absolute paths elsewhere; each one is logged. Without it they must stay inside the dump folder"""


@dataclass
class Model:
    name: str = "flame"
    """Train spec name; flame registers 'flame' (HF/fla causal LMs built from model.config)"""
    config: str = ""
    """HF model config: a config.json file or a directory holding one (e.g. configs/llama_4M.json). Defaults to model.init_from"""
    init_from: str | None = None
    """Start from a Hugging Face model's weights: its folder (config.json + *.safetensors) or a hub name in the local HF cache. Model only (optimizer, schedule and data start fresh); not applied once the dump folder holds a checkpoint, from which the run resumes (docs/fine-tuning.md)"""
    tokenizer_path: str | None = None
    """Tokenizer: a local directory, a hub name in the local HF cache, or builtin:<name>. Defaults to the model.config directory (model.init_from's) when that holds a tokenizer"""
    attention: Literal["auto", "varlen", "flex", "sdpa"] = "auto"
    """Document-masked softmax attention: varlen (torch's flash kernel, CUDA), flex (FlexAttention, CUDA), sdpa (dense mask; reference, CPU). auto = varlen on CUDA, sdpa on CPU"""
    fused_kernels: bool = True
    """HF models: RMS norms, SiLU-gated MLPs and rotary embeddings through fused kernels in eager code (torch's rms_norm; fla's swiglu and rotary kernels on CUDA), equal to HF's within rounding (flame/models/kernels/fused.py). --model.no-fused_kernels runs HF's own code: its exact rounding, or a way around a fused kernel failing on a new GPU"""
    compiled_fla_norms: bool = False
    """fla models: their fused RMSNorms (residual add included) as one torch.compile'd function instead of fla's Triton kernel: faster per norm on an H100 (flame/models/kernels/fla_norms.py; docs/perf-log.md 2026-12-07), compiled at step 1. Off until measured on whole runs"""
    fla_norms_in_compute_dtype: bool = False
    """fla models on one GPU (autocast): their fused RMSNorms hand the normed output in bf16, cast once, where fla's kernel hands float32 that each of the block's projections casts again (and whose gradients the backward casts back and sums in float32). Off until measured on whole runs"""


@dataclass
class Training:
    dataset: str = ""
    """Comma list of datasets: hub names (local HF cache), directories, files/globs of json/jsonl/parquet/txt/arrow, token files (Megatron .bin/.idx pairs or their prefix, .npy or .bin token arrays; globs too), or builtin:python-stdlib. A path whose name holds a comma is one entry when it exists"""
    dataset_name: str | None = None
    """Comma list, one per dataset: the dataset configuration name (empty entries allowed)"""
    dataset_split: str | None = None
    """Comma list, one per dataset: the split to read (default: train)"""
    data_dir: str | None = None
    """Comma list, one per dataset: data_dir passed to datasets.load_dataset"""
    data_files: str | None = None
    """Comma list, one per dataset: data_files passed to datasets.load_dataset (globs allowed)"""
    data_probs: str | None = None
    """Comma list of mixing probabilities, one per dataset (normalized if they do not sum to 1); see mix_unit"""
    mix_unit: Literal["documents", "tokens"] = "documents"
    """What data_probs are fractions of: documents drawn from each source, or tokens trained on from each source"""
    streaming: bool = False
    """Stream the datasets (nothing is downloaded or materialized up front)"""
    text_column: str | None = None
    """Column holding each document of a text source: text (default: 'text', then 'content'), or token ids (e.g. 'input_ids', used without tokenizing)"""
    data_format: str = "text"
    """Comma list, one per dataset (or one for all): text (documents, every token a target), sft (chat/instruction records: 'messages', 'prompt'/'completion' or 'instruction'/'input'/'output'), megatron (Megatron-LM .bin/.idx token files) or numpy (flat token-id arrays: .npy, raw or llm.c .bin; documents end at EOS). A text entry reads token files by the format their files tell (docs/data.md)"""
    sft_loss_on: Literal["completion", "prompt+completion"] = "completion"
    """SFT sources: the targets trained on: the assistant turns only (completion), or every token of the conversation"""
    truncate_long: bool = False
    """SFT sources: cut a conversation longer than context_len to its first context_len tokens instead of dropping it (both counted: metrics data/<source>/dropped, data/<source>/truncated)"""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """numpy sources: the dtype of a raw file's token ids (nanoGPT's train.bin, OLMo's headerless .npy); auto = uint16 when the tokenizer's vocabulary fits in 65,536 ids, else uint32. A .npy or llm.c header says its own dtype, which a given one must match in width (int32 files read as uint32)"""
    delimiters: Literal["auto", "eos", "bos", "bos+eos"] = "auto"
    """Tokens flame puts around every document: auto = EOS after and BOS before, for whichever the tokenizer defines"""
    separator_token: str | None = None
    """A token to end documents with instead of the tokenizer's EOS (needed when it defines neither BOS nor EOS); numpy sources' documents end after it"""
    document_mask: bool = True
    """Restart position ids (and attention) at every document; --training.no-document_mask concatenates documents plainly"""
    shuffle_buffer: int = 0
    """Documents held (per data shard) to shuffle a streamed source; saved in checkpoints. 0 = stream order"""
    row_shuffle_buffer: int = 0
    """Packed rows held (per data shard) to shuffle rows; saved in checkpoints. 0 = off"""
    source_exhausted: Literal["restart", "stop"] = "restart"
    """When a source runs out: restart it (new epoch, reshuffled) or stop training"""
    data_shards: int = 0
    """Logical data shards, fixed for a run: resuming on any number of ranks x workers up to this continues the same stream. 0 = max(64, readers) at the start (fewer for a smaller dataset)"""
    context_len: int | None = None
    """Longest attention span: documents longer than this are split into pieces of at most context_len (default: seq_len)"""
    varlen: bool = False
    """Pack documents into one row of seq_len tokens per device with cu_seqlens marking every document (needs batch_size 1)"""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step (derived when training.global_batch_size or global_batch_tokens fixes the global batch)"""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights, ema = decay x ema + (1 - decay) x weights after every update (e.g. 0.999), in the checkpoint, validated beside the live weights (validation/ema_*) and exportable (convert_dcp_to_hf --ema); 0 = off"""
    z_loss: float = 0.0
    """Coefficient of the z-loss, z_loss x log(Z)^2 per target (Z: the softmax's normalizer; PaLM used 1e-4), added inside the cross entropy (fused or not) and logged as loss_metrics/z_loss; 0 = off"""
    logit_softcap: float = 0.0
    """Cap the logits at +-c by c x tanh(logit / c) before the cross entropy (Gemma 2 used 30); 0 = off"""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free load balancing of a MoE model whose routers carry a selection bias (e_score_correction_bias: deepseek_v3, glm4_moe, ...): after every step each expert's bias moves by this much toward an even load over all ranks' tokens (DeepSeek-V3 used 1e-3); the bias is the model's own, kept by the checkpoint and the HF export; 0 = off"""
    global_batch_tokens: int | None = None
    """Tokens a step, whatever the GPU count: a multiple of seq_len; the gradient accumulation is derived for the data-parallel ranks (or give training.global_batch_size in rows)"""
    batch_ramp: str = ""
    """Global batch ramp, "step: rows" from step 1 (e.g. "1: 64, 501: 128, 2001: 256"): rows a step from each step on, the last the run's global batch; each rank's micro-batch stays, the accumulation follows (docs/configuration.md)"""
    lr_follows_batch: Literal["none", "sqrt", "linear"] = "none"
    """With batch_ramp: scale the lr by (rows / the largest batch's rows) to the power 1/2 (sqrt) or 1 (linear)"""
    context_ramp: str = ""
    """Context-length ramp, "step: tokens" from step 1 (e.g. "1: 512, 1001: 2048"): documents are cut to at most this many tokens from each step on (rows keep seq_len tokens), each <= context_len"""
    data_phases: str = ""
    """Data mixture phases, "step: probabilities [reset_optimizer] [restart_lr]; ..." (e.g. "2001: 0,1 reset_optimizer restart_lr"): one probability per dataset from that step on; data_probs holds before the first phase"""
    fused_cross_entropy: Literal["auto", "on", "off"] = "auto"
    """Compute the loss from the last hidden states in chunks, never materializing all logits (faster than logits + CE on CUDA; docs/perf-log-archive.md). auto = on for CUDA runs with vocab_size >= 16384"""
    skip_nan_inf: bool = False
    """Skip the update of a non-finite step (its gradient norm or loss NaN/Inf, or no target in its batch; counted and logged) instead of stopping the run"""
    max_skipped_steps: int = 10
    """With skip_nan_inf or spike_sigma: the most updates skipped in a row (NaN/Inf and spikes alike); one more stops the run (it has diverged). 0 = no limit"""
    spike_sigma: float = 0.0
    """Skip the update of a step whose loss or gradient norm is more than this many standard deviations above the mean of the last spike_window steps (counted: spike_skips). 0 = off"""
    spike_window: int = 100
    """With spike_sigma: the recent steps a step is compared with; skipped steps join it too, so a lasting shift of the loss is absorbed within a window"""
    spike_min_steps: int = 20
    """With spike_sigma: steps the window must hold before any step is judged (the first ones of a run, or of a new spike_sigma, are not)"""
    # Older spellings of torchtitan fields (ALIASES). Their defaults only show in `-h`: an alias
    # counts where the TOML file or the command line gives it.
    batch_size: int | None = None
    """Alias of training.local_batch_size: rows per device per micro-batch"""
    num_workers: int | None = None
    """Alias of training.dataloader.num_workers: data loading worker processes per rank"""
    prefetch_factor: int | None = None
    """Alias of training.dataloader.prefetch_factor: batches each worker loads ahead"""
    seed: int | None = None
    """Alias of debug.seed: the seed for weight init, data order and dropout"""
    compile: bool = False
    """Alias of compile.enable: torch.compile each decoder block"""
    data_parallel_shard_degree: int | None = None
    """Alias of parallelism.data_parallel_shard_degree"""
    data_parallel_replicate_degree: int | None = None
    """Alias of parallelism.data_parallel_replicate_degree"""
    tensor_parallel_degree: int | None = None
    """Alias of parallelism.tensor_parallel_degree"""
    warmup_steps: int | None = None
    """Alias of lr_scheduler.warmup_steps"""
    deterministic: bool = False
    """Alias of debug.deterministic: deterministic algorithms wherever torch has them"""
    disable_loss_parallel: bool = False
    """Alias of parallelism.disable_loss_parallel"""


@dataclass
class Parallelism:
    fsdp_one_rank: bool = False
    """One process: wrap the model in FSDP over a one-rank mesh all the same, for FSDP's mixed precision: each block's weights cast to bf16 as it runs and a bf16 residual stream, where torchtitan's autocast keeps a bf16 copy of every weight all step and a float32 residual stream (the elementwise ops between the matmuls move twice the bytes). Several processes shard with FSDP anyway"""
    pipeline_parallel_split_points: str = ""
    """Comma list: the index of the first decoder block of every pipeline stage after the first (e.g. 4,8,12). Empty = a balanced split (see pipeline_parallel_{first,last}_stage_less_layers)"""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """AdamW, Adam, or Muon: Muon for the weights of the decoder blocks' linear layers, AdamW (optimizer.lr, betas, eps, weight_decay) for embeddings, the head, norms and biases (docs/configuration.md)"""
    decay_everything: bool = False
    """Weight decay on every parameter. flame's default exempts embeddings, norms, biases and what the model marks _no_weight_decay (docs/configuration.md, Parameter groups)"""
    param_groups: str = ""
    """Per-group lr multiples and weight decays, ';'-separated: <kind or re:pattern>: lr=<multiple>, weight_decay=<value>; kinds: embeddings, head, norms, biases, exempt, hidden (e.g. "embeddings: lr=0.5; head: weight_decay=0")"""
    muon_lr: float | None = None
    """Muon: the lr of the hidden matrices, scaled per matrix by muon_adjust_lr and by the LR schedule (default: optimizer.lr)"""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: the step of an A x B matrix. match_rms_adamw: lr * 0.2 * sqrt(max(A, B)), an update of AdamW's RMS, so AdamW's lr serves; original: lr * sqrt(max(1, A / B)), with an lr near 0.02"""
    muon_momentum: float = 0.95
    """Muon: momentum of the gradient, in [0, 1)"""
    muon_nesterov: bool = True
    """Muon: orthogonalize the Nesterov look-ahead (gradient + momentum) rather than the momentum itself"""
    muon_weight_decay: float | None = None
    """Muon: decoupled weight decay of the hidden matrices, times the unscaled lr (default: optimizer.weight_decay)"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalize each update (1-99)"""
    scheduler: str | None = None
    """Alias of lr_scheduler.decay_type (linear, sqrt or cosine). wsd is refused: use lr_scheduler.decay_ratio"""
    min_lr_ratio: float | None = None
    """Alias of lr_scheduler.min_lr_factor: the decay ends at optimizer.lr * min_lr_ratio"""
    fused: bool = True
    """Alias of optimizer.implementation: fused when true, foreach when false"""
    on_host: bool = False
    """AdamW/Adam: keep the optimizer state (8 bytes a parameter) in host memory and step it there, overlapped with the next forward; the GPU keeps the weights and gradients. The memory plan turns it on when that is the cheapest layout that fits (docs/memory-plan.md)"""
    gpu_blocks: int = 0
    """With optimizer.on_host: the input embeddings and the first K decoder blocks keep their state on the GPU and step there, so the host starts on the blocks the next forward reaches later and the forward waits less (8 bytes a parameter of those blocks back on the GPU; 0: all on the host)"""


@dataclass
class LRScheduler:
    lr_min: float | None = None
    """Alias of lr_scheduler.min_lr_factor: the decay ends at optimizer.lr * lr_min"""


@dataclass
class Profiling:
    nsys_start_step: int | None = None
    """Nsight Systems window: cudaProfilerStart before this step (>= 1), for `nsys profile --capture-range=cudaProfilerApi`; NVTX ranges mark every step's data, forward, backward and optimizer. No-op on CPU (docs/performance.md)"""
    nsys_stop_step: int | None = None
    """Nsight Systems window: cudaProfilerStop before this step (> nsys_start_step): steps start..stop-1 are captured"""


@dataclass
class Checkpoint:
    last_save_model_only: bool = False
    """Save only the model at the last step. flame's default keeps the final checkpoint complete so the run can be extended"""
    enable_checkpoint: bool = False
    """Alias of checkpoint.enable"""
    model_weights_only: bool = False
    """Alias of checkpoint.last_save_model_only"""
    export_as: Literal["auto", "native", "llama"] = "auto"
    """Architecture of the HF export (train.sh's, and convert_dcp_to_hf's default): native = the model's own; llama = fla's transformer as LlamaForCausalLM, the same weights under llama's names, for tools that read only standard architectures (vLLM, SGLang, llama.cpp), options llama cannot express (qk_norm, window_size, ...) refused at preflight; auto = llama where the model's own architecture loads only with flash-attn (fla's transformer) and llama expresses it, else native: the export's log line and model card say which and why"""
    accept_changes: str = ""
    """Comma list of run-identity fields a resume may change on purpose (model, tokenizer, data, seed, seq_len, context_len, batch, optimizer, lr, schedule): a resume that differs from the run that saved its checkpoint in any other is refused at preflight; an accepted change applies from the resumed step on (docs/checkpoints.md)"""


@dataclass
class Metrics:
    rank_0_only: bool = True
    """Alias of metrics.save_for_all_ranks, inverted: false saves the metrics of every rank"""


@dataclass
class Experimental:
    pipeline_parallel_degree: int | None = None
    """Alias of parallelism.pipeline_parallel_degree"""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Alias of parallelism.pipeline_parallel_split_points: module names (layers.4,layers.8) become block indices (4,8)"""
    pipeline_parallel_schedule: str | None = None
    """Alias of parallelism.pipeline_parallel_schedule"""
    pipeline_parallel_schedule_csv: str | None = None
    """Refused: flame builds the schedule from parallelism.pipeline_parallel_schedule"""
    pipeline_parallel_microbatches: int | None = None
    """Refused: use parallelism.pipeline_parallel_microbatch_size (rows per microbatch)"""
    pipeline_parallel_split_mode: str | None = None
    """Refused: flame splits the model by decoder blocks (parallelism.pipeline_parallel_split_points)"""
    context_parallel_degree: int | None = None
    """Alias of parallelism.context_parallel_degree"""


@dataclass
class MemoryEstimation:
    enabled: bool = False
    """Refused: flame estimates memory with --memory.plan"""


@dataclass
class Memory:
    plan: Literal["auto", "off"] = "off"
    """auto: fit the job into GPU memory before it starts: estimate each part (docs/memory-plan.md) and, if the job does not fit as configured, take the fastest layout that fits (full AC of the first K blocks or of all; FSDP resharding; CPU offload; the optimizer state on the host; micro-batches; and their mixes), priced from this machine's measured rates; settings you give are kept. off (default until the estimates are checked on GPUs) = change nothing; giving a budget turns it on"""
    gpu_budget_gib: str = "auto"
    """GPU memory one process may use, in GiB; auto = the GPU's memory less 1 GiB (CUDA context, NCCL). On a CPU machine auto plans nothing; a number plans as for a GPU of that size"""
    host_budget_gib: str = "auto"
    """Host memory one process may use for CPU offload, in GiB; auto = 90% of the available RAM, shared by the processes of a host"""
    stream_weights: bool = False
    """Keep the float32 weights and AdamW's state on the host and stream each decoder block's weights to the GPU in the compute dtype as the forward and the backward reach it, its gradients back as the backward makes them; the host steps each block while the next forward runs. The GPU holds two blocks' weights and one block's gradients beside the activations; data-parallel processes each hold and stream a shard (docs/memory-plan.md)"""


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing of decoder blocks: none, full, or selective (see selective_ac_option)"""
    blocks: int | None = None
    """With mode full: checkpoint only the first N decoder blocks and keep the others' activations (less recomputed, more memory; the memory plan picks N to fit a budget). Unset = every block"""
    offload: bool = False
    """With mode full: the checkpointed blocks' inputs wait in host memory between the forward and the backward, copied on a side stream as each block ends and back one block ahead of its backward (the model's last block keeps its own)"""


@dataclass
class Lora:
    rank: int | None = None
    """LoRA fine-tuning: train adapters of this rank on --lora.targets while the model's own weights stay frozen (PEFT's LoRA layers). Unset = train every weight"""
    alpha: float = 16.0
    """LoRA: an adapter adds (alpha / rank) x B(A(x)) to its layer's output"""
    dropout: float = 0.0
    """LoRA: dropout on each adapter's input (PEFT's lora_dropout)"""
    targets: str = "all-linear"
    """LoRA: comma list of the linear layers that get adapters, each a module name or its last parts (q_proj,v_proj: those of every block); all-linear = every linear layer but the output head"""
    export: Literal["adapter", "merged"] = "adapter"
    """LoRA: what the HF export writes: adapter (PEFT's adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained) or merged (a plain model with the adapters added into its weights)"""


@dataclass
class Float8:
    recipe_name: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "off"
    """FP8 training of linear layers (torchao's Float8Linear): tensorwise = one scale per tensor (under FSDP the weights are all-gathered in FP8), rowwise = one per row (closer to bf16, costlier casts), rowwise_with_gw_hp = rowwise with the weight gradient in bf16; off = bf16 matmuls. Weights, gradients, optimizer state, checkpoints and exports stay as they are. Needs a GPU of compute capability 8.9+ (H100, L40S); a CPU run emulates the FP8 matmuls (numerics, not speed). MFU keeps counting the matmuls' FLOPs against bf16's peak (docs/float8.md)"""
    layers: Literal["auto", "all"] = "auto"
    """auto: time each linear shape of the model on this GPU, forward and backward at the job's tokens per micro-batch, in bf16 and FP8, and convert only the shapes FP8 makes faster (measured once per machine, logged); all: every eligible linear layer (dimensions multiples of 16; never the output head, MoE routers or LoRA adapters)"""
    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers that stay bf16: comma list of module names or their last parts (o_proj, layers.0.mlp.down_proj)"""
    enable_fsdp_float8_all_gather: bool = True
    """tensorwise under FSDP: all-gather the converted layers' weights in FP8 (half of bf16's bytes) instead of casting them after a bf16 all-gather"""
    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With enable_fsdp_float8_all_gather: compute every gathered weight's scale in one pass after each optimizer step (one all-reduce), instead of one per weight in each all-gather"""
    # the older spelling (ALIASES): true meant tensorwise
    enable_float8_linear: bool = False
    """Alias of float8.recipe_name: true = tensorwise, false = off"""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate a fixed validation set every validation.freq steps and after the last step (docs/evaluation.md)"""
    dataset: str = ""
    """Comma list of validation datasets, in --training.dataset's syntax; or hold documents out of the training data (holdout_documents)"""
    dataset_name: str | None = None
    """Comma list, one per validation dataset: the dataset configuration name"""
    dataset_split: str | None = None
    """Comma list, one per validation dataset: the split to read (default: train)"""
    data_dir: str | None = None
    """Comma list, one per validation dataset: data_dir passed to datasets.load_dataset"""
    data_files: str | None = None
    """Comma list, one per validation dataset: data_files passed to datasets.load_dataset (globs allowed)"""
    data_format: str = "text"
    """Comma list, one per validation dataset (or one for all): a format, as --training.data_format"""
    holdout_documents: int = 0
    """Instead of validation.dataset: the first N documents (in dataset order) of every training source are never trained on and form the validation set (map-style sources)"""
    freq: int = 500
    """Evaluate every this many steps (and after the last step)"""
    steps: int = -1
    """Batches of each validation source evaluated, over all data-parallel ranks together; -1 = all of them"""
    local_batch_size: int | None = None
    """Rows per batch (default: training.batch_size)"""
    seq_len: int | None = None
    """Tokens per row (default: training.seq_len)"""

    def __post_init__(self):
        pass  # torchtitan's assertion would print a traceback; flame checks these in one line (config_manager)


@dataclass
class Eval:
    tasks: str = ""
    """lm-eval tasks scored during training (comma list, e.g. piqa,hellaswag): each saved checkpoint of an evaluation step goes to python -m flame.eval in the background (docs/evaluation.md)"""
    interval: int = 0
    """Steps between evaluations, a multiple of checkpoint.interval. 0 = every checkpoint step"""
    include_path: str | None = None
    """Folder of your own lm-eval task YAML files (lm-eval's --include_path; configs/eval/ holds an example)"""
    limit: float | None = None
    """At most this many examples per task (a fraction of them when < 1): lm-eval's --limit, for quick checks"""
    batch_size: int = 8
    """lm-eval's --batch_size (model types that do not honour padding score one sequence at a time)"""
    num_fewshot: int | None = None
    """lm-eval's --num_fewshot (default: each task's own)"""
    device: str = "auto"
    """Where the evaluations run: auto = rank 0's device (on a GPU they share it, and its memory, with training), or e.g. cpu"""


@dataclass
class Debug:
    seed: int | None = 42
    """Seed for weight init, data order and dropout (same seed, same run)"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    profiling: Profiling = field(default_factory=Profiling)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    experimental: Experimental = field(default_factory=Experimental)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    memory: Memory = field(default_factory=Memory)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    lora: Lora = field(default_factory=Lora)
    float8: Float8 = field(default_factory=Float8)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    debug: Debug = field(default_factory=Debug)

"""Parallelism for any HF/fla causal LM: the layout's degrees, checked from the config (degrees),
FSDP2/HSDP/DDP, activation checkpointing and compile (parallelize), tensor parallelism
(tensor_parallel, its per-rank module runs in tp_local), context parallelism (context_parallel)
and pipeline parallelism (pipeline)."""

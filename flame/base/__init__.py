"""The ground floor: what every layer may use and that uses no other layer of flame's.

errors (the error types), device (the one CPU/gloo vs CUDA/NCCL seam), batch_context (the batch
being computed), process (a process tied to its parent, rank names), paths (``~`` and environment
variables expanded), cli (the subcommands' flag style), dump_folder (one run per
folder, its attempts), run_record (what a run left, read back), autotune (shipped Triton choices),
triton_kernels (shipped Triton kernels compiled before step 1 on spare CPUs), compile_watch (what
Triton compiles, said in the log while a step waits),
measured_once (a per-machine measurement cache), hub (hub names: the local HF cache first, the hub briefly).
"""

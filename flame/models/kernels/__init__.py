"""flame's own kernels for the models it builds: document attention, fused norms/MLPs/rotary, Mamba's selective
scan, flash-attn's internals for MoBA, the meta stand-in the memory plan measures them with."""

"""Optimizers: one record per optimizer (record; the optimizers' files: adamw, muon), the TrainSpec hooks that
build them and their LR schedules (builder), and AdamW stepping on the host (host). Adding one: README.md here."""

# each file registers its optimizer's record (flame.optim.record.OPTIMIZERS), in this order
from flame.optim import adamw, muon  # noqa: F401

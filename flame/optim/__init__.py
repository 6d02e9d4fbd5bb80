"""Optimizers: torchtitan's Adam/AdamW and flame's Muon (builder), and AdamW stepping on the host (host)."""

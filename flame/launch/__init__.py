"""train.sh's side: the job's check before any rank starts (preflight), the per-node launcher (supervise) and a
Slurm step's node settings (slurm)."""

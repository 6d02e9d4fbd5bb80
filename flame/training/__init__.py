"""The training loop: flame's Trainer (torchtitan's, with flame's hooks) and what it runs each step: the update
guard and its spike policy, metrics, validation, background evaluation, the Nsight Systems window, and the outputs
besides checkpoints (side_outputs: metrics files, TensorBoard, traces), whose failures never end a run."""

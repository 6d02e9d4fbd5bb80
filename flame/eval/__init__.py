"""Downstream evaluation with lm-evaluation-harness: ``python -m flame.eval`` (flame.eval.__main__).

- flame.eval.model: the model scored, an HF export or a dump folder's DCP step loaded in memory,
  inside lm-eval's own HF model class (data parallel under torchrun, batching by model type);
- flame.eval.tasks: lm-eval's tasks by name, built before the model (one-line errors);
- flame.eval.report: lm-eval's results files, results.md, and the scores in the run's logs.

Training starts it in the background at checkpoints (--eval.tasks: flame.training.evaluation).
"""

"""Where flame.eval's scores go: lm-eval's results files and a markdown table, and the run's own logs.

- ``<folder>/<model>/results_<date>.json`` (and ``samples_*.jsonl`` with --log_samples): lm-eval's
  own files, written by its EvaluationTracker as ``lm_eval --output_path <folder>`` writes them;
  ``<folder>/results.md``: lm-eval's table. The folder: --output_path, else
  ``<dump_folder>/eval/step-N`` for a dump folder's step, else ``<model>/eval``.
- A dump folder's run also gets the scores at their step, as ``eval/<task>/<metric>``: one line
  appended to metrics.jsonl (flame.base.run_record) and, when the run wrote TensorBoard files, an
  event file in its latest TensorBoard folder. W&B gets them from the trainer when the run itself
  started the evaluation (flame.training.evaluation): a W&B run takes one writer at a time.
"""

import glob
import logging
import os

from lm_eval.loggers import EvaluationTracker
from lm_eval.utils import make_table

from flame.base import run_record
from flame.checkpoint.export import run_settings
from flame.eval.model import Source

logger = logging.getLogger("flame.eval")
TABLE = "results.md"


def output_folder(source: Source, output_path: str | None) -> str:
    """Where lm-eval's files go (a folder, or a .json file's name as lm-eval takes it)."""
    if output_path:
        return output_path
    if source.dump_folder is not None:
        return os.path.join(source.dump_folder, "eval", f"step-{source.step}")
    return os.path.join(source.path, "eval")


def tracker(folder: str, hub_args: dict) -> EvaluationTracker:
    """lm-eval's writer of its results files, as its command line makes it."""
    return EvaluationTracker(**{**hub_args, "output_path": folder})


def save(results: dict, samples: dict | None, writer: EvaluationTracker) -> None:
    """Write lm-eval's results files (and samples, when logged), as its command line writes them."""
    writer.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples is not None else ():
        writer.save_results_samples(task_name=task, samples=samples[task])


def write_table(results: dict, folder: str) -> str:
    """``results.md``: lm-eval's table of the scores (printed too); its path. Written last: the
    scores are already in the results files and the run's logs if the table fails."""
    table = make_table(results) + (f"\n{make_table(results, 'groups')}" if "groups" in results else "")
    directory = os.path.dirname(folder) if folder.endswith(".json") else folder
    os.makedirs(directory or ".", exist_ok=True)
    path = os.path.join(directory, TABLE)
    with open(path, "w") as f:
        f.write(table)
    print(table)
    return path


def log_to_run(source: Source, results: dict) -> dict[str, float]:
    """Add the scores to the logs of the run whose step was scored: metrics.jsonl and TensorBoard. The scores logged."""
    scores = {f"eval/{name}": value for name, value in run_record.results_scores(results.get("results")).items()}
    if source.dump_folder is None or not scores:
        return scores
    # the latest attempt's: a reader merges the records of a step attempt by attempt (run_record.metrics)
    run_record.append_metrics(source.dump_folder, {"step": source.step, "attempt": run_record.latest_attempt(source.dump_folder),
                                                   **scores})
    if folder := _tensorboard_folder(source.dump_folder):
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=folder, filename_suffix=".flame-eval") as writer:
            for name, value in scores.items():
                writer.add_scalar(name, value, source.step)
    logger.info(f"scores of step {source.step} added to {source.dump_folder}/{run_record.METRICS_FILE}"
                f"{f' and TensorBoard ({folder})' if folder else ''}")
    return scores


def _tensorboard_folder(dump_folder: str) -> str | None:
    """The run's latest TensorBoard folder (<dump_folder>/<metrics.save_tb_folder>/<date-time>), if it wrote one."""
    metrics = run_settings(dump_folder).get("metrics", {})
    if not metrics.get("enable_tensorboard"):
        return None
    folders = [f for f in glob.glob(os.path.join(glob.escape(dump_folder), metrics.get("save_tb_folder", "tb"), "*"))
               if glob.glob(os.path.join(glob.escape(f), "events.out.tfevents.*"))]
    return max(folders, default=None)

"""A run's curves as one PNG; several runs overlaid, to compare them by looking.

    python -m flame.tools.plot <dump> [<dump> ...] [--out curves.png] [--labels a,b]

Each quantity a run logged is a row of two panels, against steps (left) and tokens trained
(right): training loss (with validation loss, dashed, on the same nats-per-token scale),
validation bits per byte, learning rate, gradient norm, tokens/s per device, and eval scores
(points, one series per task and metric). A row shows only when some run logged its quantity.
Each run keeps one colour in every panel. Steps logged by several attempts (a resume) show the
latest attempt's values (flame.base.run_record.metrics).

flame.launch.supervise writes <dump_folder>/curves.png at the end of every train.sh run; this command
draws any dump folders (one: <dump>/curves.png by default; several: ./curves.png).
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from flame.base import run_record
from flame.base.errors import ConfigError

CURVES_FILE = "curves.png"
STEPS, TOKENS = "step", "tokens trained"


@dataclass
class Run:
    """One dump folder's logged metrics and eval scores, under a label."""

    label: str
    records: dict[int, dict[str, Any]]
    scores: dict[int, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, dump_folder: str, label: str | None = None) -> "Run":
        records = run_record.metrics(dump_folder)
        name = label or os.path.basename(os.path.normpath(os.path.abspath(dump_folder)))
        return cls(name, records, run_record.eval_scores(dump_folder, records))

    def tokens(self, steps: list[int]) -> list[float]:
        """Tokens trained by each step (logged, or from the nearest logged step: every step trains as many)."""
        found = [run_record.tokens_at(self.records, step) for step in steps]
        return [float("nan") if value is None else value for value in found]


@dataclass(frozen=True)
class Quantity:
    """A row of panels: its title and the (metrics key, line style, label suffix) series it draws."""

    title: str
    lines: tuple[tuple[str, str, str], ...]


QUANTITIES = (
    Quantity("loss (nats/token)", ((run_record.LOSS, "-", ""), (run_record.VALIDATION_LOSS, "--", " validation"))),
    Quantity("validation bits per byte", ((run_record.VALIDATION_BPB, "--", " validation"),)),
    Quantity("learning rate", (("lr", "-", ""),)),
    Quantity("gradient norm", (("grad_norm", "-", ""),)),
    Quantity("tokens/s per device", (("throughput(tps)", "-", ""),)),
)
EVAL_TITLES = ("eval scores", "eval scores, other scales")  # fractions in [0, 1] | perplexities and the like


def _logged(runs: list[Run], quantity: Quantity) -> bool:
    return any(run_record.series(run.records, key)[0] for run in runs for key, _, _ in quantity.lines)


def figure(runs: list[Run]):
    """The figure of ``runs`` (a matplotlib Figure, Agg canvas): one row per quantity logged, steps | tokens."""
    from matplotlib.figure import Figure  # Agg canvas, no display: works on any machine

    rows = [quantity for quantity in QUANTITIES if _logged(runs, quantity)]
    score_rows = [names for names in _score_names(runs) if names]
    count = len(rows) + len(score_rows)
    fig = Figure(figsize=(13, 3.1 * max(count, 1)), layout="constrained")
    if count == 0:
        return fig
    axes = fig.subplots(count, 2, squeeze=False)
    colours = [f"C{index % 10}" for index in range(len(runs))]
    for row, quantity in zip(axes, rows):
        for ax, x_axis in zip(row, (STEPS, TOKENS)):
            for run, colour in zip(runs, colours):
                for key, style, suffix in quantity.lines:
                    steps, values = run_record.series(run.records, key)
                    if steps:
                        x = steps if x_axis == STEPS else run.tokens(steps)
                        marker = "o" if style == "--" and len(steps) < 50 else None
                        ax.plot(x, values, style, color=colour, marker=marker, markersize=3, label=run.label + suffix)
            _finish(ax, quantity.title, x_axis)
    for row, (title, names) in zip(axes[len(rows):], ((t, n) for t, n in zip(EVAL_TITLES, _score_names(runs)) if n)):
        for ax, x_axis in zip(row, (STEPS, TOKENS)):
            _draw_scores(ax, runs, colours, x_axis, names)
            _finish(ax, title, x_axis)
    return fig


def _score_names(runs: list[Run]) -> tuple[list[str], list[str]]:
    """The eval scores' names: those whose values are all fractions, and the others (perplexities, ...)."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for scores in run.scores.values():
            for name, value in scores.items():
                values.setdefault(name, []).append(value)
    fractions = sorted(name for name, found in values.items() if all(0 <= value <= 1 for value in found))
    return fractions, sorted(set(values) - set(fractions))


def _draw_scores(ax, runs: list[Run], colours: list[str], x_axis: str, names: list[str]) -> None:
    markers = "os^vD<>pP*Xh"
    for run, colour in zip(runs, colours):
        for index, name in enumerate(names):
            steps = [step for step, scores in run.scores.items() if name in scores]
            if steps:
                x = steps if x_axis == STEPS else run.tokens(steps)
                values = [run.scores[step][name] for step in steps]
                ax.plot(x, values, linestyle=":" if len(steps) > 1 else "", marker=markers[index % len(markers)],
                        color=colour, label=f"{run.label} {name}")


def _finish(ax, title: str, x_axis: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(x_axis)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")


def write(runs: list[Run], out: str):
    """Write ``runs``' figure to ``out`` (PNG) and return the figure."""
    fig = figure(runs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


def write_run_curves(dump_folder: str) -> str | None:
    """<dump_folder>/curves.png of one run (None when it logged no step)."""
    if not os.path.isfile(os.path.join(dump_folder, run_record.METRICS_FILE)):
        return None
    out = os.path.join(dump_folder, CURVES_FILE)
    write([Run.load(dump_folder)], out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dumps", nargs="+", metavar="DUMP", help="dump folders of runs (--job.dump_folder)")
    parser.add_argument("--out", help=f"the PNG to write (default: <dump>/{CURVES_FILE} for one run, ./{CURVES_FILE} for several)")
    parser.add_argument("--labels", help="comma list: a legend label per run (default: the folders' names)")
    args = parser.parse_args(argv)
    try:
        labels = args.labels.split(",") if args.labels else [None] * len(args.dumps)
        if len(labels) != len(args.dumps):
            raise ConfigError(f"--labels gives {len(labels)} labels for {len(args.dumps)} runs: give one per run")
        for dump in args.dumps:
            if not os.path.isdir(dump):
                raise ConfigError(f"{dump} is not a folder: give the dump folder of a run (its --job.dump_folder)")
        runs = [Run.load(dump, label) for dump, label in zip(args.dumps, labels)]
    except ConfigError as error:
        print(f"flame.tools.plot: error: {error}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.dumps[0], CURVES_FILE) if len(runs) == 1 else CURVES_FILE)
    write(runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A run's curves as one PNG; several runs overlaid, to compare them by looking.

    flame plot <dump> [<dump> ...] [--out curves.png] [--labels a,b]      (or python -m flame.tools.plot)

One panel per quantity, stacked in one column against steps: loss (training, and validation dashed:
both nats per token), bits per byte (validation, and lm-eval's bits_per_byte), eval scores between
0 and 1 (accuracies), a panel per other eval metric (word perplexity, ...), learning rate, gradient
norm, tokens/s per device. A panel shows only when some run logged its quantity. No axis holds two
units or spans decades on a linear scale: perplexities are on log axes, any other panel is log
where its positive values span a decade or more (a warm-up's learning rate, early gradient spikes).
Left out as redundant: validation perplexity (the validation loss, exponentiated) and a task's
byte perplexity where it logs bits per byte (2 to that power).

Tokens trained: every step of a run trains as many tokens, so tokens are steps times that number.
When the runs share it (one run always does), the top panel has a tokens axis on top: one column
says it all. Runs that train different tokens per step get a second column, against tokens, since
steps then do not line up the same work. Each run keeps one colour in every panel; one legend per
figure names the runs (several) and the line kinds (training, validation, each eval metric's marker).
Steps logged by several attempts (a resume) show the latest attempt's values (run_record.metrics).

flame.launch.supervise writes <dump_folder>/curves.png at the end of every train.sh run; this command
draws any dump folders (one: <dump>/curves.png by default; several: ./curves.png).
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from flame.base import run_record
from flame.base.cli import ArgumentParser
from flame.base.errors import ConfigError

CURVES_FILE = "curves.png"
STEPS, TOKENS = "step", "tokens trained"
TRAINING, VALIDATION = "training", "validation"  # the line kinds of logged metrics; an eval score's kind is its name
LINEAR, LOG, AUTO = "linear", "log", "auto"  # AUTO: log where the positive values span a decade or more
MARKERS = "os^vD<>pP*Xh"


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

    def tokens_per_step(self) -> float | None:
        """The tokens each step trains, from the last logged token count (None when the run logged none)."""
        found = run_record.last(self.records, run_record.TOKENS)
        return found[1] / found[0] if found and found[0] > 0 else None


@dataclass
class Series:
    """One line of a panel: a run's values of one metric, ``label`` naming both (the legend shows ``kind``)."""

    run: int
    label: str
    kind: str
    steps: list[int]
    values: list[float]


@dataclass
class Panel:
    """One quantity in one unit: its title, y label (the unit), scale, and the series drawn."""

    title: str
    unit: str
    scale: str
    series: list[Series] = field(default_factory=list)


# (title, unit, scale, ((metrics key, kind), ...)); the bits-per-byte panel also takes eval bits per byte
LOGGED = (
    ("loss (nats/token)", "nats/token", AUTO, ((run_record.LOSS, TRAINING), (run_record.VALIDATION_LOSS, VALIDATION))),
    ("bits per byte", "bits/byte", AUTO, ((run_record.VALIDATION_BPB, VALIDATION),)),
    ("learning rate", "learning rate", AUTO, (("lr", TRAINING),)),
    ("gradient norm (L2, before clipping)", "L2 norm", AUTO, (("grad_norm", TRAINING),)),
    ("throughput (tokens/s per device)", "tokens/s", AUTO, (("throughput(tps)", TRAINING),)),
)
LOSS_PANEL, BPB_PANEL = LOGGED[0][0], LOGGED[1][0]
EVAL_FRACTIONS = "eval scores (0 to 1)"


def panels(runs: list[Run]) -> list[Panel]:
    """The panels of ``runs``' figure, in the module docstring's order; only those with something to draw."""
    made = {title: Panel(title, unit, scale) for title, unit, scale, _ in LOGGED}
    for title, _, _, lines in LOGGED:
        for index, run in enumerate(runs):
            for key, kind in lines:
                steps, values = run_record.series(run.records, key)
                if steps:
                    suffix = "" if kind == TRAINING else f" {kind}"
                    made[title].series.append(Series(index, run.label + suffix, kind, steps, values))
    evals = {}
    for name, panel in _eval_panels(runs).items():
        panel = made.get(panel.title) or evals.setdefault(panel.title, panel)
        for index, run in enumerate(runs):
            steps = [step for step, scores in run.scores.items() if name in scores]
            if steps:
                values = [run.scores[step][name] for step in steps]
                panel.series.append(Series(index, f"{run.label} {name}", name, steps, values))
    ordered = [made[LOSS_PANEL], made[BPB_PANEL], *sorted(evals.values(), key=_eval_order),
               *(made[title] for title, *_ in LOGGED[2:])]
    return [panel for panel in ordered if panel.series]


def _eval_panels(runs: list[Run]) -> dict[str, Panel]:
    """Eval score name -> the panel of its unit: bits per byte, a fraction, or its metric's own (perplexities
    log scale). A task's byte_perplexity is left out where it logs bits_per_byte: it is 2 to that power."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for scores in run.scores.values():
            for name, value in scores.items():
                values.setdefault(name, []).append(value)
    found = {}
    for name in sorted(values):
        task, _, metric = name.rpartition("/")
        if metric in ("bits_per_byte", "bpb"):
            found[name] = Panel(BPB_PANEL, "bits/byte", AUTO)
        elif metric == "byte_perplexity" and f"{task}/bits_per_byte" in values:
            continue
        elif "perplexity" in metric:
            found[name] = Panel(f"eval {metric.replace('_', ' ')} (log scale)", "perplexity", LOG)
        elif all(0 <= value <= 1 for value in values[name]):
            found[name] = Panel(EVAL_FRACTIONS, "score", LINEAR)
        else:
            found[name] = Panel(f"eval {metric}", metric, AUTO)
    return found


def _eval_order(panel: Panel) -> tuple[bool, str]:
    return panel.title != EVAL_FRACTIONS, panel.title


def shared_tokens_per_step(runs: list[Run]) -> tuple[bool, float | None]:
    """(whether one column is enough, the tokens per step of its tokens axis): runs that logged no
    token count do not count; several distinct numbers need a tokens column."""
    found = {round(value, 6) for run in runs if (value := run.tokens_per_step()) is not None}
    return len(found) <= 1, next(iter(found), None)


def figure(runs: list[Run]):
    """The figure of ``runs`` (a matplotlib Figure, Agg canvas): a panel per quantity, against steps."""
    from matplotlib.figure import Figure  # Agg canvas, no display: works on any machine

    drawn = panels(runs)
    one_column, per_step = shared_tokens_per_step(runs)
    columns = (STEPS,) if one_column else (STEPS, TOKENS)
    fig = Figure(figsize=(8.5 if one_column else 14, 2.4 * max(len(drawn), 1) + 1), layout="constrained")
    if len(runs) == 1:
        fig.suptitle(runs[0].label)
    if not drawn:
        fig.text(0.5, 0.5, "no metrics logged yet", ha="center")
        return fig
    axes = fig.subplots(len(drawn), len(columns), squeeze=False, sharex="col")
    colours = [f"C{index % 10}" for index in range(len(runs))]
    kinds = _kinds(drawn)
    for row, panel in enumerate(drawn):
        for column, x_axis in enumerate(columns):
            ax = axes[row][column]
            for series in panel.series:
                x = series.steps if x_axis == STEPS else runs[series.run].tokens(series.steps)
                ax.plot(x, series.values, color=colours[series.run], label=series.label, **kinds[series.kind])
            _finish(ax, panel, x_axis, column == 0, row == len(drawn) - 1)
    if one_column and per_step:
        tokens = axes[0][0].secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
        tokens.set_xlabel(TOKENS, loc="right")  # clear of the panel's title, centred above it
        tokens.xaxis.set_major_formatter(_count_formatter())
    _legend(fig, runs, colours, kinds)
    return fig


def _kinds(drawn: list[Panel]) -> dict[str, dict[str, Any]]:
    """Line kind drawn -> its style: training solid, validation dashed, each eval score dotted with its marker."""
    present = {series.kind for panel in drawn for series in panel.series}
    points = max((len(series.steps) for panel in drawn for series in panel.series if series.kind == VALIDATION),
                 default=0)
    kinds: dict[str, dict[str, Any]] = {
        TRAINING: {"linestyle": "-"},
        VALIDATION: {"linestyle": "--", "marker": "o" if points < 50 else None, "markersize": 3},
    }
    kinds = {kind: style for kind, style in kinds.items() if kind in present}
    for index, name in enumerate(sorted(present - {TRAINING, VALIDATION})):
        kinds[name] = {"linestyle": ":", "marker": MARKERS[index % len(MARKERS)], "markersize": 5}
    return kinds


def _finish(ax, panel: Panel, x_axis: str, first_column: bool, bottom: bool) -> None:
    ax.set_title(panel.title)
    values = [value for line in ax.get_lines() for value in line.get_ydata() if value > 0]
    log = panel.scale == LOG or (panel.scale == AUTO and bool(values) and max(values) >= 10 * min(values))
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(_minor_log_labels())
    elif panel.title == EVAL_FRACTIONS:
        ax.set_ylim(-0.03, 1.03)
    if first_column:
        ax.set_ylabel(panel.unit + (", log scale" if log else ""))
    if bottom:
        ax.set_xlabel(x_axis)
    if x_axis == TOKENS:
        ax.xaxis.set_major_formatter(_count_formatter())
    ax.grid(alpha=0.3, which="both" if log else "major")


def _minor_log_labels():
    """Labels at some minor ticks of log axes spanning up to two decades (matplotlib's stop at one): an axis
    from 200 to 5,000 tokens/s would otherwise read 10^3 alone."""
    from matplotlib.ticker import LogFormatterSciNotation

    return LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(2, 0.5))


def _count_formatter():
    """Tick labels for token counts: 40k, 1.2M, 3B."""
    from matplotlib.ticker import FuncFormatter

    def label(value: float, _position) -> str:
        for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= size:
                return f"{value / size:.3g}{suffix}"
        return f"{value:.3g}"

    return FuncFormatter(label)


def _legend(fig, runs: list[Run], colours: list[str], kinds: dict[str, dict[str, Any]]) -> None:
    """One legend for the figure: the runs' colours (several runs) and the line kinds (when not just training)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colour, linewidth=3, label=run.label) for run, colour in zip(runs, colours)]
    handles = handles if len(runs) > 1 else []
    if set(kinds) != {TRAINING}:
        colour = "0.3" if len(runs) > 1 else colours[0]
        handles += [Line2D([], [], color=colour, label=kind if kind in (TRAINING, VALIDATION) else f"{kind} (eval)",
                           **style) for kind, style in kinds.items()]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize="small")


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
    parser = ArgumentParser(prog="flame plot", description=__doc__.split("\n")[0])
    parser.add_argument("dumps", nargs="+", path=True, metavar="DUMP", help="dump folders of runs (--job.dump_folder)")
    parser.add_argument("--out", path=True, help=f"the PNG to write (default: <dump>/{CURVES_FILE} for one run, ./{CURVES_FILE} for several)")
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
        print(f"flame plot: error: {error}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.dumps[0], CURVES_FILE) if len(runs) == 1 else CURVES_FILE)
    write(runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

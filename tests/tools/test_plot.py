"""`flame plot` (flame.tools.plot): the curves of runs, overlaid, from their dump folders."""

import io
import json
import shutil
from pathlib import Path

import pytest

from flame.tools import plot
from tests.conftest import metrics

STEPS = list(range(1, 41))


def panels(fig) -> dict[tuple[str, int], dict]:
    """(title, column) -> the panel's y label, y scale, y limits and {line label: y values}, in drawing order."""
    return {(ax.get_title(), ax.get_subplotspec().colspan.start): {
        "ylabel": ax.get_ylabel(), "yscale": ax.get_yscale(), "ylim": ax.get_ylim(),
        "lines": {line.get_label(): [float(y) for y in line.get_ydata()] for line in ax.get_lines()}}
        for ax in fig.axes}


def write_run(folder: Path, tokens_per_step: int = 2048, lr: float = 1e-3, scores: dict | None = None) -> Path:
    """A dump folder whose metrics.jsonl logs 40 steps as flame does: a warm-up from lr/100 to lr in 10 steps,
    a gradient norm that spikes early, validation (loss, perplexity, bits per byte) at steps 20 and 40,
    and lm-eval results of step 40 (``scores``: {task: {metric: value}})."""
    folder.mkdir(parents=True)
    rows = [{"step": step, "attempt": 1, "loss_metrics/global_avg_loss": 10.0 - step / 10, "lr": lr / 10 ** (2 * max(0, 10 - step) / 9),
             "grad_norm": 80.0 if step < 3 else 0.5 + step / 100, "throughput(tps)": 2000.0 + step,
             "n_tokens_seen": tokens_per_step * step} for step in STEPS]
    rows += [{"step": step, "attempt": 1, "validation/loss": 9.0 - step / 20, "validation/ppl": 30000.0 - step,
              "validation/bpb": 2.5 - step / 100} for step in (20, 40)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if scores:
        results = folder / "eval" / "step-40" / "model"
        results.mkdir(parents=True)
        (results / "results_2026-01-01.json").write_text(json.dumps(
            {"results": {task: {f"{metric},none": value for metric, value in values.items()} for task, values in scores.items()}}))
    return folder


WIKITEXT = {"wikitext": {"word_perplexity": 30000.0, "byte_perplexity": 4.0, "bits_per_byte": 2.0},
            "piqa": {"acc": 0.55, "acc_norm": 0.6}}


def test_two_runs_overlay_with_the_latest_attempts_values_validation_and_eval_scores(single_process_run, tmp_path):
    first = single_process_run
    # a second run: the first's log, resumed after step 2 by an attempt that logged steps 3-4 again
    # (other losses), with validation records and lm-eval results of step 4 as flame writes them
    second = tmp_path / "resumed"
    second.mkdir()
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    again = [dict(row, attempt=2, **{"loss_metrics/global_avg_loss": 1.0 + row["step"]}) for row in rows if row["step"] > 2]
    validation = [{"step": step, "attempt": 2, "validation/loss": 5.0 - step / 4, "validation/bpb": 2.0 - step / 8}
                  for step in (2, 4)]
    (second / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows + again + validation))
    results = second / "eval" / "step-4" / "model"
    results.mkdir(parents=True)
    (results / "results_2026-01-01.json").write_text(json.dumps(
        {"results": {"piqa": {"alias": "piqa", "acc,none": 0.55, "acc_stderr,none": 0.01},
                     "wikitext": {"alias": "wikitext", "word_perplexity,none": 900.0}}}))

    out = tmp_path / "compare.png"
    assert plot.main([str(first), str(second), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    drawn = panels(plot.figure([plot.Run.load(str(first)), plot.Run.load(str(second))]))
    titles = ["loss (nats/token)", "bits per byte", "eval scores (0 to 1)", "eval word perplexity (log scale)",
              "learning rate", "gradient norm (L2, before clipping)", "throughput (tokens/s per device)"]
    assert list(drawn) == [(title, 0) for title in titles]  # the same tokens per step: one column
    loss = drawn["loss (nats/token)", 0]["lines"]
    assert loss[first.name] == [row["loss_metrics/global_avg_loss"] for row in metrics(first).values()]
    assert loss["resumed"][2:] == [4.0, 5.0]  # steps 3 and 4: the resuming attempt's values
    assert loss["resumed validation"] == [4.5, 4.0]
    assert drawn["eval scores (0 to 1)", 0]["lines"] == {"resumed piqa/acc": [0.55]}
    assert drawn["eval word perplexity (log scale)", 0]["lines"] == {"resumed wikitext/word_perplexity": [900.0]}
    assert set(drawn["learning rate", 0]["lines"]) == {first.name, "resumed"}


def test_one_run_is_one_column_against_steps_with_tokens_on_a_top_axis(tmp_path):
    fig = plot.figure([plot.Run.load(str(write_run(tmp_path / "run", tokens_per_step=2048)))])
    fig.savefig(io.BytesIO())  # lays the figure out: the tokens axis takes its limits from the steps'
    assert {ax.get_subplotspec().get_geometry()[1] for ax in fig.axes} == {1}
    assert [ax.get_xlabel() for ax in fig.axes] == [""] * (len(fig.axes) - 1) + ["step"]
    assert all(not ax.child_axes for ax in fig.axes[1:])
    (tokens,) = fig.axes[0].child_axes
    assert tokens.get_xlabel() == "tokens trained"
    assert tokens.get_xlim() == pytest.approx(tuple(2048 * x for x in fig.axes[0].get_xlim()))
    assert fig.get_suptitle() == "run"


def test_no_axis_mixes_units_and_values_that_span_decades_get_a_log_axis(tmp_path):
    fig = plot.figure([plot.Run.load(str(write_run(tmp_path / "run", scores=WIKITEXT)))])
    drawn = {title: panel for (title, _), panel in panels(fig).items()}
    assert {title: (panel["ylabel"], panel["yscale"]) for title, panel in drawn.items()} == {
        "loss (nats/token)": ("nats/token", "linear"),
        "bits per byte": ("bits/byte", "linear"),
        "eval scores (0 to 1)": ("score", "linear"),
        "eval word perplexity (log scale)": ("perplexity, log scale", "log"),
        "learning rate": ("learning rate, log scale", "log"),  # a warm-up from a hundredth
        "gradient norm (L2, before clipping)": ("L2 norm, log scale", "log"),  # early spikes of 80, then about 0.5
        "throughput (tokens/s per device)": ("tokens/s", "linear"),
    }
    assert set(drawn["loss (nats/token)"]["lines"]) == {"run", "run validation"}  # both nats per token
    assert drawn["bits per byte"]["lines"] == {"run validation": [2.3, 2.1], "run wikitext/bits_per_byte": [2.0]}
    assert drawn["eval scores (0 to 1)"]["lines"] == {"run piqa/acc": [0.55], "run piqa/acc_norm": [0.6]}
    assert drawn["eval scores (0 to 1)"]["ylim"] == pytest.approx((-0.03, 1.03))
    # validation perplexity (the validation loss, exponentiated) and byte perplexity (2 ** bits per byte) are not drawn
    assert drawn["eval word perplexity (log scale)"]["lines"] == {"run wikitext/word_perplexity": [30000.0]}
    for title, panel in drawn.items():
        values = [value for line in panel["lines"].values() for value in line if value > 0]
        assert panel["yscale"] == "log" or max(values) < 10 * min(values), title


def test_three_runs_overlay_in_one_column_with_one_legend(tmp_path):
    dumps = [str(write_run(tmp_path / name, lr=lr, scores=WIKITEXT)) for name, lr in (("a", 1e-3), ("b", 3e-3), ("c", 1e-2))]
    out = tmp_path / "three.png"
    assert plot.main([*dumps, "--out", str(out), "--labels", "low,mid,high"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    fig = plot.figure([plot.Run.load(dump, label) for dump, label in zip(dumps, ("low", "mid", "high"))])
    assert {ax.get_subplotspec().get_geometry()[1] for ax in fig.axes} == {1}
    assert len(fig.axes[0].child_axes) == 1  # the runs share their tokens per step: one tokens axis on top
    (legend,) = fig.legends
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert [text.get_text() for text in legend.get_texts()][:5] == ["low", "mid", "high", "training", "validation"]
    rate = next(ax for ax in fig.axes if ax.get_title() == "learning rate")
    assert [(line.get_label(), line.get_color()) for line in rate.get_lines()] == [("low", "C0"), ("mid", "C1"), ("high", "C2")]
    assert [line.get_ydata()[-1] for line in rate.get_lines()] == pytest.approx([1e-3, 3e-3, 1e-2])


def test_runs_of_different_tokens_per_step_add_a_tokens_column(tmp_path):
    dumps = [str(write_run(tmp_path / name, tokens_per_step=size)) for name, size in (("small", 2048), ("large", 8192))]
    fig = plot.figure([plot.Run.load(dump) for dump in dumps])
    loss = [ax for ax in fig.axes if ax.get_title() == "loss (nats/token)"]
    assert [ax.get_subplotspec().colspan.start for ax in loss] == [0, 1]
    assert [ax.get_xlabel() for ax in fig.axes[-2:]] == ["step", "tokens trained"]
    tokens = {line.get_label(): list(line.get_xdata()) for line in loss[1].get_lines()}
    assert tokens["small"] == [2048 * step for step in STEPS] and tokens["large"] == [8192 * step for step in STEPS]
    assert not any(ax.child_axes for ax in fig.axes)


def test_one_run_is_drawn_into_its_dump_folder(single_process_run, tmp_path):
    dump = tmp_path / "run"
    dump.mkdir()
    shutil.copy(single_process_run / "metrics.jsonl", dump / "metrics.jsonl")
    assert plot.main([str(dump)]) == 0
    assert (dump / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.write_run_curves(str(tmp_path / "nothing logged")) is None


def test_a_folder_without_metrics_is_refused_in_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("flame plot: error:") and f"{tmp_path} has no metrics.jsonl" in error
    assert plot.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert plot.main([str(tmp_path), str(tmp_path), "--labels", "one"]) == 2
    assert "--labels gives 1 labels for 2 runs" in capsys.readouterr().err

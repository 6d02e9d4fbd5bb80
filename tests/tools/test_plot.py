"""`python -m flame.tools.plot`: the curves of runs, overlaid, from their dump folders."""

import json
import shutil

from flame.tools import plot
from tests.conftest import metrics


def panels(fig) -> dict[tuple[str, str], dict[str, list]]:
    """(title, x label) -> {line label: y values} of every panel of a curves figure."""
    return {(ax.get_title(), ax.get_xlabel()): {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
            for ax in fig.axes}


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
    titles = ["loss (nats/token)", "validation bits per byte", "learning rate", "gradient norm", "tokens/s per device",
              "eval scores", "eval scores, other scales"]
    assert list(drawn) == [(title, x) for title in titles for x in ("step", "tokens trained")]
    loss = drawn["loss (nats/token)", "step"]
    assert loss[first.name] == [row["loss_metrics/global_avg_loss"] for row in metrics(first).values()]
    assert loss["resumed"][2:] == [4.0, 5.0]  # steps 3 and 4: the resuming attempt's values
    assert loss["resumed validation"] == [4.5, 4.0]
    assert drawn["eval scores", "tokens trained"] == {"resumed piqa/acc": [0.55]}
    assert drawn["eval scores, other scales", "step"] == {"resumed wikitext/word_perplexity": [900.0]}
    assert set(drawn["learning rate", "tokens trained"]) == {first.name, "resumed"}


def test_one_run_is_drawn_into_its_dump_folder(single_process_run, tmp_path):
    dump = tmp_path / "run"
    dump.mkdir()
    shutil.copy(single_process_run / "metrics.jsonl", dump / "metrics.jsonl")
    assert plot.main([str(dump)]) == 0
    assert (dump / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_folder_without_metrics_is_refused_in_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{tmp_path} has no metrics.jsonl" in error
    assert plot.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err

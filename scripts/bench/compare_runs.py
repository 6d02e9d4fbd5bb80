"""Loss curves of multi-GPU runs against their 1-GPU reference (tp_check.sh, cp_check.sh).

    python scripts/bench/compare_runs.py <out dir> <title>

Runs are folders named <model>-<variant>; each is compared with <model>-1gpu (or
<model>-1gpu_bf16 when the variant ends in _bf16): the largest relative loss difference, and
the losses.
"""

import json
import pathlib
import sys


def curve(out: pathlib.Path, name: str) -> dict[int, float] | None:
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = {json.loads(line)["step"]: json.loads(line) for line in path.read_text().splitlines()}
    return {step: row["loss_metrics/global_avg_loss"] for step, row in sorted(rows.items())}


def main() -> None:
    out, title = pathlib.Path(sys.argv[1]), sys.argv[2]
    print(f"=== {title} ===")
    for run in sorted(p.name for p in out.iterdir() if p.is_dir()):
        model, _, variant = run.partition("-")
        got, ref = curve(out, run), curve(out, f"{model}-1gpu" + ("_bf16" if variant.endswith("_bf16") else ""))
        if got is None:
            print(f"{run:28s} no metrics (see {out / run}.log)")
            continue
        diff = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in got if s in ref), default=float("nan")) if ref else float("nan")
        print(f"{run:28s} max rel diff {diff:.1e}  losses {' '.join(f'{v:.4f}' for v in got.values())}")


if __name__ == "__main__":
    main()

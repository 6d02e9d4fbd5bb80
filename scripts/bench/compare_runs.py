"""Loss curves and speed of GPU check runs against their references (tp_check.sh, cp_check.sh, scale_check.sh).

    python scripts/bench/compare_runs.py <out dir> <title> [run=reference ...] [--baseline run]

Each run is a folder of <out dir> holding metrics.jsonl. Without pairs, every run is compared
with the run of its naming convention: <model>-<variant> with <model>-1gpu (or
<model>-1gpu_bf16 when the variant ends in _bf16). With pairs, only the named runs are
listed, each against its reference ('-' for none). Per run: the largest relative loss
difference from the reference over their common steps, the losses, and (logged every step)
tokens/s per GPU, MFU and peak reserved memory averaged over the second half of the steps.
--baseline adds each run's tokens/s per GPU as a share of that run's (weak-scaling efficiency).
"""

import argparse
import json
import pathlib


def read(out: pathlib.Path, name: str) -> dict[int, dict] | None:
    path = out / name / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["step"]: row for row in sorted(rows, key=lambda row: row["step"])}


def loss(rows: dict[int, dict]) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in rows.items()}


def late_mean(rows: dict[int, dict], key: str) -> float:
    """Mean of ``key`` over the second half of the logged steps (after warm-up and autotuning)."""
    steps = sorted(rows)
    late = [rows[s][key] for s in steps[len(steps) // 2:] if rows[s].get(key) is not None]
    return sum(late) / len(late) if late else float("nan")


def reference_of(run: str) -> str:
    model, _, variant = run.partition("-")
    return f"{model}-1gpu" + ("_bf16" if variant.endswith("_bf16") else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("title")
    parser.add_argument("pairs", nargs="*", help="run=reference ('-' for none)")
    parser.add_argument("--baseline")
    args = parser.parse_intermixed_args()

    if args.pairs:
        pairs = [tuple(pair.split("=", 1)) for pair in args.pairs]
    else:
        pairs = [(p.name, reference_of(p.name)) for p in sorted(args.out.iterdir()) if p.is_dir()]
    base = read(args.out, args.baseline) if args.baseline else None
    base_tps = late_mean(base, "throughput(tps)") if base else None

    print(f"=== {args.title} ===")
    print(f"{'run':22s} {'reference':14s} {'max rel diff':>12s} {'tok/s/GPU':>10s} {'MFU %':>6s} {'mem GiB':>8s}"
          + (f" {'vs ' + args.baseline:>10s}" if args.baseline else "") + "  losses")
    for run, reference in pairs:
        rows = read(args.out, run)
        if rows is None:
            print(f"{run:22s} no metrics (see {args.out / run}.log)")
            continue
        got, ref_rows = loss(rows), read(args.out, reference) if reference != "-" else None
        ref = loss(ref_rows) if ref_rows else {}
        common = [s for s in got if s in ref]
        diff = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common) if common else float("nan")
        tps = late_mean(rows, "throughput(tps)")
        line = (f"{run:22s} {reference:14s} {diff:12.1e} {tps:10,.0f} {late_mean(rows, 'mfu(%)'):6.1f} "
                f"{late_mean(rows, 'memory/max_reserved(GiB)'):8.1f}")
        if args.baseline:
            line += f" {100 * tps / base_tps:9.0f}%" if base_tps else f" {'':>10s}"
        shown = list(got.values())
        print(line + "  " + " ".join(f"{v:.4f}" for v in (shown if len(shown) <= 10 else shown[:3] + shown[-3:])))


if __name__ == "__main__":
    main()

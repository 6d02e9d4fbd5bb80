"""The summary lines of each suite, from the steps' logs and metrics (one function per Suite.report)."""

import json
import re
import statistics
from pathlib import Path

from flame.base import run_record
from scripts.bench.plan import BLOCK_LINES
from scripts.bench.runs import Result

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_PREFIX = re.compile(r".*INFO - ")  # torchtitan's logger prefix before flame's step lines
NAN = float("nan")


def outcome(result: Result) -> str:
    if result.status is None:
        return f"not run ({result.note})"
    text = "ok" if result.status == 0 else "stopped at its limit" if result.status == 124 else f"exit {result.status}"
    return f"{text}, {result.seconds:.0f} s" + (f"; {result.note}" if result.note else "")


def log_lines(work: Path, result: Result) -> list[str]:
    path = work / f"{result.step.name}.log"
    return [ANSI.sub("", line) for line in path.read_text(errors="replace").splitlines()] if path.is_file() else []


# flame.training.metrics, after the first logged step of a run with --memory.plan auto
PLANNED = re.compile(r"memory: measured peak ([\d.]+) GiB reserved, planned ([\d.]+) GiB")


def plan_against_peak(work: Path, result: Result) -> str:
    """The memory plan's estimate and its error against the measured peak; "" where the run planned nothing."""
    found = [match for line in log_lines(work, result) if (match := PLANNED.search(line))]
    if not found:
        return ""
    measured, planned = float(found[-1][1]), float(found[-1][2])
    return f"  planned {planned:.1f} GiB ({100 * (planned / measured - 1):+.0f}% of the measured peak {measured:.1f})"


def last_json(work: Path, result: Result) -> dict | None:
    """The last JSON line a worker printed (it prints one after every stage)."""
    for line in reversed(log_lines(work, result)):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def lines(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """Each command's outcome and the log lines its ``show`` and ``show_block`` pick (the last line by default)."""
    shown = []
    for result in results:
        shown.append(f"{result.step.name}: {outcome(result)}")
        text = log_lines(work, result)
        step = result.step
        picked = [] if step.show or step.show_block else text[-1:]
        for i, line in enumerate(text):
            if step.show and re.search(step.show, line):
                picked.append(LOG_PREFIX.sub("", line))
            elif step.show_block and re.search(step.show_block, line):
                picked += text[i : i + 1 + BLOCK_LINES]
        shown += [f"  {line}" for line in picked]
    return shown


def metrics(work: Path, name: str) -> dict[int, dict] | None:
    """step -> what the run logged (its lines merged as flame.base.run_record merges them), None without a log."""
    path = work / name
    return run_record.metrics(str(path)) or None if (path / run_record.METRICS_FILE).is_file() else None


def late_mean(rows: dict[int, dict], key: str) -> float:
    """Mean of ``key`` over the second half of the logged steps (after warm-up and autotuning)."""
    steps = sorted(rows)
    late = [rows[s][key] for s in steps[len(steps) // 2:] if rows[s].get(key) is not None]
    return sum(late) / len(late) if late else NAN


def losses(rows: dict[int, dict]) -> dict[int, float]:
    return {step: row["loss_metrics/global_avg_loss"] for step, row in rows.items()}


def runs(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """train.sh runs against their references: the largest relative loss difference over their common
    steps, tokens/s per GPU, MFU and peak reserved memory (second half of the steps), the losses."""
    header = (f"{'run':24s} {'reference':18s} {'max rel diff':>12s} {'tok/s/GPU':>10s} {'MFU %':>6s} {'mem GiB':>8s}"
              + (f" {'vs ' + baseline:>10s}" if baseline else "") + "  losses")
    shown = lines([r for r in results if not r.step.train], work) + [header]
    for result in (r for r in results if r.step.train):
        step = result.step
        rows = metrics(work, step.name)
        if result.status is None or rows is None:
            shown.append(f"{step.name:24s} {outcome(result)}; no metrics" + ("" if result.status is None else
                                                                             f" (see {step.name}.log)"))
            continue
        got = losses(rows)
        ref_rows = metrics(work, step.reference) if step.reference else None
        ref = losses(ref_rows) if ref_rows else {}
        common = [s for s in got if s in ref]
        diff = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common) if common else NAN
        tps = late_mean(rows, "throughput(tps)")
        line = (f"{step.name:24s} {step.reference or '-':18s} {diff:12.1e} {tps:10,.0f} "
                f"{late_mean(rows, 'mfu(%)'):6.1f} {late_mean(rows, 'memory/max_reserved(GiB)'):8.1f}")
        if baseline:  # the same config's baseline run
            base_rows = metrics(work, f"{Path(step.config).stem}-{baseline}")
            base_tps = late_mean(base_rows, "throughput(tps)") if base_rows else NAN
            line += f" {100 * tps / base_tps:9.0f}%" if base_tps > 0 else f" {'':>10s}"
        values = list(got.values())
        line += "  " + " ".join(f"{v:.4f}" for v in (values if len(values) <= 10 else values[:3] + values[-3:]))
        line += plan_against_peak(work, result)
        shown.append(line + ("" if result.status == 0 else f"  ({outcome(result)})"))
    return shown


def zoo(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """One line per model config: varlen parity, eager and compiled training, errors."""
    shown = []
    for result in results:
        row = last_json(work, result) or {"done": "nothing"}
        parts = []
        if "parity_logits" in row:
            parts.append(f"parity={row['parity_logits']:.4f}/{row['parity_grads']:.4f}")
        for mode in ("eager", "compile"):
            if mode in row:
                m = row[mode]
                memory = "" if m.get("peak_mem_gib") is None else f" mem={m['peak_mem_gib']:.2f}GiB"  # null on CPU
                extra = f" recompiles={m['graphs_compiled_after_step5']}" if mode == "compile" else ""
                parts.append(f"{mode}: trains={m['trains']} loss {m['loss_first']:.2f}->{m['loss_last']:.2f} "
                             f"tok/s={m['tokens_per_s']:,.0f}{memory}{extra}")
        if "ac_full_max_loss_diff" in row:
            parts.append(f"AC full/op {row['ac_full_max_loss_diff']:.0e}/{row.get('ac_selective_max_loss_diff', NAN):.0e}")
        if "error" in row:
            parts.append(f"ERROR {row['error'][:150]}")
        elif row.get("done") != "all":  # stopped at its limit (or crashed) after that stage
            parts.append(f"ERROR {outcome(result)} after stage {row.get('done')} (see {result.step.name}.log)")
        shown.append(f"{result.step.config:42s} " + " | ".join(parts))
    return shown


def number(row: dict, key: str) -> float:
    """``row[key]``, NaN where it is missing or null (e.g. memory on the CPU)."""
    value = row.get(key)
    return NAN if value is None else value


def throughput(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """Per config: the plain PyTorch loop against flame's run on the same model and data.

    The plain loop's tokens/s is at its median step, its TFLOPS the mean over its timed steps;
    flame's figures are its last logged window (e.g. steps 21-30).
    """
    shown = [f"{'config':28s} {'plain tok/s':>12s} {'flame tok/s':>12s} {'flame/plain':>11s} "
             f"{'TFLOPS plain':>12s} {'flame':>6s} {'mem GiB plain':>13s} {'flame':>6s}"]
    configs = dict.fromkeys(r.step.config for r in results)
    for config in configs:
        plain = next((last_json(work, r) for r in results if r.step.config == config and not r.step.train), None) or {}
        flame_result = next((r for r in results if r.step.config == config and r.step.train), None)
        rows = metrics(work, flame_result.step.name) if flame_result else None
        last = rows[max(rows)] if rows else {}
        plain_tps, flame_tps = number(plain, "tokens_per_s"), number(last, "throughput(tps)")
        ratio = flame_tps / plain_tps if plain_tps > 0 else NAN
        shown.append(
            f"{Path(config).stem:28s} {plain_tps:12,.0f} {flame_tps:12,.0f} {ratio:11.3f} "
            f"{number(plain, 'tflops'):12.1f} {number(last, 'tflops'):6.1f} "
            f"{number(plain, 'peak_mem_gib'):13.1f} {number(last, 'memory/max_reserved(GiB)'):6.1f}"
        )
    for result in results:
        if result.status != 0:
            shown.append(f"  {result.step.name}: {outcome(result)}")
    return shown


# torchtitan's line per logged step (torchtitan.components.metrics.MetricsProcessor.log), e.g.
# "step: 20  loss:  7.12345  grad_norm:  1.2345  memory: 40.12GiB(50.70%)  tps: 115,234  tflops: 250.12  mfu: 25.29%"
TORCHTITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*\S+\s+memory:\s*([\d.]+)GiB\S*\s+"
                             r"tps:\s*([\d,]+)\s+tflops:\s*([\d.,]+)\s+mfu:\s*(\S+)%")
PARAMETERS = re.compile(r"size: ([\d,]+) total parameters")  # torchtitan's Trainer logs it (flame's too)
SIDES = ("torchtitan", "flame", "plain")


def torchtitan_windows(text: list[str]) -> list[dict]:
    """torchtitan's logged windows in order: step, loss, peak reserved GiB, tokens/s, TFLOPS and its MFU."""
    windows = []
    for line in text:
        if match := TORCHTITAN_STEP.search(line):
            step, loss, memory, tps, tflops, mfu = match.groups()
            windows.append({"step": int(step), "loss": float(loss), "memory_gib": float(memory),
                            "tps": float(tps.replace(",", "")), "tflops": float(tflops.replace(",", "")),
                            "mfu": float(mfu)})
    return windows


def parameter_count(text: list[str]) -> int | None:
    """The model's parameter count as the trainer logged it."""
    found = [PARAMETERS.search(line) for line in text]
    return next((int(m.group(1).replace(",", "")) for m in reversed(found) if m), None)


def tokens_per_step(step) -> int | None:
    """The step's tokens per step, read from its command line (one row: flame's seq_len, the workers' --tokens/--seq)."""
    argv = [*step.common, *step.argv]
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--training.seq_len", "--tokens", "--seq")]
    return int(values[-1]) if values else None


def peer_measurement(result: Result, side: str, work: Path) -> dict:
    """A finished run's last window: tokens/s, MFU (flame's count), peak reserved GiB, parameters ({} if none)."""
    if result.status != 0:
        return {}
    text = log_lines(work, result)
    if side == "torchtitan":
        windows = torchtitan_windows(text)
        if not windows:
            return {}
        return {"tps": windows[-1]["tps"], "memory": windows[-1]["memory_gib"], "params": parameter_count(text)}
    if side == "flame":
        rows = metrics(work, result.step.name)
        if not rows:
            return {}
        last = rows[max(rows)]
        return {"tps": last.get("throughput(tps)"), "mfu": last.get("mfu(%)"),
                "memory": last.get("memory/max_reserved(GiB)"), "params": parameter_count(text)}
    row = last_json(work, result) or {}
    return {"tps": row.get("tokens_per_s"), "memory": row.get("peak_mem_gib"), "params": row.get("params")} if row else {}


def figure(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def peers(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """One table: per config and mode, torchtitan's own trainer, flame and the plain loop side by side.

    Items are named <side>[-compiled|-fp8] (fp8: flame compiled with FP8 linear layers, against torchtitan's
    compiled bf16 run). A config without torchtitan runs of its own (an fla
    transformer) is compared with the torchtitan run of the config with its parameter count
    and tokens per step (the llama of its size), named under the table.
    """
    found: dict[tuple[str, str], dict[str, dict]] = {}  # (config, mode) -> side -> measurement
    tokens = {}
    for result in results:
        side, _, mode = result.step.item.partition("-")
        key = (result.step.config, mode or "eager")
        found.setdefault(key, {})[side] = peer_measurement(result, side, work)
        tokens[key] = tokens_per_step(result.step)
    header = (f"{'model':18s} {'tokens':>7s} {'mode':8s} {'params tt':>13s} {'params flame':>13s} {'tok/s tt':>9s} "
              f"{'tok/s flame':>11s} {'tok/s plain':>11s} {'flame/tt':>8s} {'flame/plain':>11s} {'MFU% flame':>10s} "
              f"{'GiB tt':>6s} {'GiB flame':>9s} {'GiB plain':>9s}")
    shown, notes = [header], []
    for (config, mode), sides in found.items():  # in the order the steps ran
        name = Path(config).stem
        flame, plain = sides.get("flame", {}), sides.get("plain", {})
        # the config's parameter count, from whichever of its runs finished (both modes build the same model)
        params = next((m["params"] for (c, _), other in found.items() if c == config for side, m in other.items()
                       if side != "torchtitan" and m.get("params")), None)
        # flame's FP8 runs (compiled) beside torchtitan's compiled bf16: the speed FP8 adds over the peer
        peer = found.get((config, "compiled"), {}).get("torchtitan") if mode == "fp8" else sides.get("torchtitan")
        if peer is None:  # no torchtitan run of its own: the one of its size
            twins = [c for (c, m), other in found.items() if m == mode and tokens[(c, m)] == tokens[(config, mode)]
                     and other.get("torchtitan") and other["torchtitan"]["params"] == params]
            peer = found[(twins[0], mode)]["torchtitan"] if twins else {}
            if twins:
                notes.append(f"{name} {mode}: torchtitan's columns are {Path(twins[0]).stem}'s run "
                             f"(the same {params:,} parameters and tokens per step)")
        if peer.get("params") and params and peer["params"] != params:
            notes.append(f"WARNING {name} {mode}: torchtitan's model has {peer['params']:,} parameters, "
                         f"flame's {params:,}: not the same shapes")
        shown.append(
            f"{name:18s} {figure(tokens[(config, mode)]):>7s} {mode:8s} {figure(peer.get('params')):>13s} "
            f"{figure(params):>13s} {figure(peer.get('tps')):>9s} {figure(flame.get('tps')):>11s} "
            f"{figure(plain.get('tps')):>11s} {figure(ratio(flame.get('tps'), peer.get('tps')), '.2f'):>8s} "
            f"{figure(ratio(flame.get('tps'), plain.get('tps')), '.2f'):>11s} {figure(flame.get('mfu'), '.1f'):>10s} "
            f"{figure(peer.get('memory'), '.1f'):>6s} {figure(flame.get('memory'), '.1f'):>9s} "
            f"{figure(plain.get('memory'), '.1f'):>9s}")
    notes.append("tt: torchtitan's own llama3 trainer; tok/s: tt's and flame's last logged window (the last half of "
                 "the steps), the plain loop's median over those steps; MFU by flame's count (attention per document; "
                 "tt's own counts attention over the whole row, so it is not compared); GiB: peak reserved")
    notes += [f"{r.step.name}: {outcome(r)}" + ("" if r.status is None else f" (see {r.step.name}.log)")
              for r in results if r.status != 0]
    return shown + [f"  {note}" for note in notes]


def scaling(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """Per config and GPU count, torchtitan's and flame's tokens/s per GPU, flame/torchtitan, and the share
    of its one-GPU rate each side keeps (weak scaling: every GPU gets the same tokens). Items are named
    <side>-<GPUs>; under --repeat each figure is the median of the side's runs, beside their range."""
    found: dict[str, dict[int, dict[str, list[dict]]]] = {}  # config -> GPUs -> side -> measurement per run
    for result in results:
        side, _, count = result.step.item.partition("-")
        found.setdefault(result.step.config, {}).setdefault(int(count), {}).setdefault(side, []).append(
            peer_measurement(result, side, work))
    header = (f"{'model':18s} {'tokens/GPU':>10s} {'GPUs':>4s} {'tok/s/GPU tt':>12s} {'tok/s/GPU flame':>15s} "
              f"{'flame/tt':>8s} {'kept tt':>7s} {'kept flame':>10s} {'MFU% flame':>10s} {'GiB tt':>6s} {'GiB flame':>9s} "
              f"{'range tt':>15s} {'range flame':>15s}")
    shown = [header]
    for config, sizes in found.items():
        tokens = next(tokens_per_step(r.step) for r in results if r.step.config == config)
        one = {side: median_of(measured, "tps") for side, measured in sizes.get(1, {}).items()}
        for count, sides in sorted(sizes.items()):
            tt, flame = sides.get("torchtitan", []), sides.get("flame", [])
            tps = {"torchtitan": median_of(tt, "tps"), "flame": median_of(flame, "tps")}
            kept = {side: percent(ratio(tps[side], one.get(side))) for side in tps}
            shown.append(
                f"{Path(config).stem:18s} {figure(tokens):>10s} {count:4d} {figure(tps['torchtitan']):>12s} "
                f"{figure(tps['flame']):>15s} {figure(ratio(tps['flame'], tps['torchtitan']), '.2f'):>8s} "
                f"{kept['torchtitan']:>7s} {kept['flame']:>10s} {figure(median_of(flame, 'mfu'), '.1f'):>10s} "
                f"{figure(median_of(tt, 'memory'), '.1f'):>6s} {figure(median_of(flame, 'memory'), '.1f'):>9s} "
                f"{spread(tt):>15s} {spread(flame):>15s}")
    notes = ["tt: torchtitan's own llama3 trainer; tok/s per GPU over the last logged window; kept: tok/s per GPU "
             "as a share of the same side's one-GPU run (weak scaling); GiB: peak reserved; range: the lowest and "
             "highest tok/s per GPU of a side's runs (--repeat), with their count"]
    notes += [f"{r.step.name}: {outcome(r)}" + ("" if r.status is None else f" (see {r.step.name}.log)")
              for r in results if r.status != 0]
    return shown + [f"  {note}" for note in notes]


def median_of(measurements: list[dict], key: str) -> float | None:
    """The median of ``key`` over the runs that measured it (None if none did)."""
    values = [m[key] for m in measurements if m.get(key) is not None]
    return statistics.median(values) if values else None


def spread(measurements: list[dict]) -> str:
    """``n: lowest-highest`` tok/s of a side's runs, in thousands; '-' below two runs."""
    values = sorted(m["tps"] for m in measurements if m.get("tps") is not None)
    return f"{len(values)}: {values[0] / 1e3:.1f}-{values[-1] / 1e3:.1f}K" if len(values) > 1 else "-"


def profiles(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """The runs' table, then each run's profiled step by kernel kind (its <name>.profile.txt, runs.py)."""
    shown = runs(results, work, baseline)
    for result in results:
        summary = work / f"{result.step.name}.profile.txt"
        if summary.is_file():
            shown += ["", f"{result.step.name}:", *summary.read_text().splitlines()]
    return shown


def curves(results: list[Result], work: Path, baseline: str | None = None) -> list[str]:
    """Per config, the runs' loss curves side by side (every logged step), then per run: tokens/s and
    step time against the baseline run (second half of the steps), and the first step at which
    its loss is at or below the baseline's last (the same loss in fewer tokens when earlier)."""
    shown = []
    for config in dict.fromkeys(r.step.config for r in results if r.step.train):
        done = [r for r in results if r.step.config == config and r.step.train]
        rows = {r.step.item: metrics(work, r.step.name) for r in done}
        curves_ = {item: losses(found) for item, found in rows.items() if found}
        base = curves_.get(baseline)
        tokens = tokens_per_step(done[0].step)
        shown.append(f"{Path(config).stem}: loss per logged step ({tokens:,} tokens per step)" if tokens
                     else f"{Path(config).stem}: loss per logged step")
        shown.append(f"  {'step':>6s} " + " ".join(f"{item:>10s}" for item in curves_))
        for step in sorted(set().union(*curves_.values())) if curves_ else []:
            shown.append(f"  {step:6d} " + " ".join(f"{curve[step]:10.4f}" if step in curve else f"{'-':>10s}"
                                                   for curve in curves_.values()))
        base_tps = late_mean(rows[baseline], "throughput(tps)") if base else NAN
        for result in done:
            item, curve = result.step.item, curves_.get(result.step.item)
            if not curve:
                shown.append(f"  {item}: {outcome(result)}; no metrics")
                continue
            tps = late_mean(rows[item], "throughput(tps)")
            line = f"  {item}: {tps:,.0f} tok/s"
            if base and item != baseline:
                target = base[max(base)]
                reached = next((step for step in sorted(curve) if curve[step] <= target), None)
                line += (f", step time {100 * (base_tps / tps - 1):+.1f}% vs {baseline}; reaches {baseline}'s last loss "
                         f"{target:.4f} at step {reached if reached else 'never'} (of {max(base)})")
            shown.append(line + ("" if result.status == 0 else f" ({outcome(result)})"))
    return shown


REPORTS = {"lines": lines, "runs": runs, "zoo": zoo, "throughput": throughput, "peers": peers, "scaling": scaling,
           "curves": curves, "profiles": profiles}

"""The harness's command line (scripts/chaos/__init__.py says what it does): run, print, tally."""

import argparse
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import scripts.chaos
from flame.base.process import STOP_SIGNALS
from scripts.chaos import damage, kills, signals, two_runs, writes
from scripts.chaos.runs import Job, Reference, run_reference


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _table(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).rjust(w) if i else str(cell).ljust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in [header, *rows])


def kill_tally(trials: list[kills.Trial], procs: list[int]) -> str:
    rows = []
    for name, group in [(f"{p} process{'es' if p > 1 else ''}", [t for t in trials if t.procs == p]) for p in procs] + [
            ("all", trials)]:
        landed = [(t, k) for t in group for k in t.landed]
        rows.append([name, len(landed), sum(t.resumed for t, _ in landed), sum(t.identical for t, _ in landed),
                     sum(k.mid_save for _, k in landed), sum(k.mid_export for _, k in landed),
                     sum(bool(k.orphans) for _, k in landed), sum(not k.landed for t in group for k in t.kills),
                     f"{sum(t.export_ok for t in group)}/{len(group)}", sum(bool(t.staging_left) for t in group)])
    return _table(["kills", "tried", "resumed", "bit-identical", "mid-save", "mid-export", "left orphans",
                   "missed", "exports ok", "staging left"], rows)


def damage_tally(results: list[damage.Damage]) -> str:
    rows = [[r.case, r.file, _yes(r.detected), _yes(r.named), _yes(r.traceback), _yes(r.fell_back), _yes(r.identical)]
            for r in results]
    return _table(["damage", "file", "detected", "file named", "traceback", "fell back", "reference losses"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.chaos", description=scripts.chaos.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--signals", type=int, default=2,
                        help="stop signals in all, per process count of --procs: SIGTERM, SIGINT, SIGHUP and SIGUSR1 to the "
                             "process group or the launcher in turn (default 2)")
    parser.add_argument("--stop-signals", type=lambda value: {f"SIG{name.strip().upper().removeprefix('SIG')}"
                                                              for name in value.split(",")},
                        default={sig.name for sig in STOP_SIGNALS},
                        help="which stop signals the signal trials send, comma-separated (default all: TERM,INT,HUP,USR1)")
    parser.add_argument("--kills", type=int, default=6, help="kill -9s in all, shared among --procs (default 6)")
    parser.add_argument("--procs", default="1,2", help="process counts to run, comma-separated (default 1,2)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every random choice (default 0)")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the job (default 12)")
    parser.add_argument("--interval", type=int, default=2, help="a checkpoint every this many steps (default 2)")
    parser.add_argument("--damage", default=",".join(damage.CASES),
                        help=f"damage cases, comma-separated, or 'none' (default all: {', '.join(damage.CASES)})")
    parser.add_argument("--writes", default=",".join(writes.CASES),
                        help=f"failing-write cases, comma-separated, or 'none' (default all: {', '.join(writes.CASES)})")
    parser.add_argument("--no-two-runs", action="store_true", help="skip the two-runs-on-one-folder case")
    parser.add_argument("--grace", type=float, default=5,
                        help="seconds a killed run's processes get to die before they count as orphans (default 5)")
    parser.add_argument("--train-flags", default="", help="more train.sh flags for every run, one quoted string")
    parser.add_argument("--work", type=Path, help="where the runs go (default: a new folder in the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every dump folder (default: only the output of every attempt)")
    parser.add_argument("--short", action="store_true",
                        help="a quick pass: 2 kills on 1 process, 6 steps, damage truncate-distcp, a full disk at a save, two runs")
    args = parser.parse_args(argv)
    if unknown := args.stop_signals - {sig.name for sig in STOP_SIGNALS}:
        parser.error(f"--stop-signals: {', '.join(sorted(unknown))} is not a stop signal; give TERM, INT, HUP or USR1")
    if args.short:
        args.kills, args.signals, args.procs, args.steps, args.damage = 2, 1, "1", 6, "truncate-distcp"
        args.writes = "full-disk-at-a-save"
    procs = [int(p) for p in args.procs.split(",")]
    cases = [] if args.damage == "none" else args.damage.split(",")
    if unknown := [c for c in cases if c not in damage.CASES]:
        parser.error(f"unknown damage case {unknown[0]}: choose among {', '.join(damage.CASES)}")
    write_cases = [] if args.writes == "none" else args.writes.split(",")
    if unknown := [c for c in write_cases if c not in writes.CASES]:
        parser.error(f"unknown writes case {unknown[0]}: choose among {', '.join(writes.CASES)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="flame-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    began = time.monotonic()
    print(f"chaos: work folder {work}", flush=True)

    references: dict[int, Reference] = {}
    for p in procs:
        job = Job(work / f"reference-{p}" / "dump", p, args.steps, args.interval, shlex.split(args.train_flags))
        references[p] = run_reference(job, work / f"reference-{p}" / "run")
        print(f"reference, {p} process(es): {references[p].duration:.1f} s, final loss "
              f"{references[p].losses[args.steps]:.4f}", flush=True)

    trials = []
    for number, (p, kinds) in enumerate(kills.plan(args.kills, procs, rng), 1):
        trial = kills.run_trial(f"kill-{number}-p{p}", references[p], kinds, work, rng, args.grace, args.keep)
        trials.append(trial)
        print(f"\n{trial.name}: resumed {_yes(trial.resumed)}, bit-identical {_yes(trial.identical)}", flush=True)
        for kill in trial.kills:
            print(f"  {kill.planned} kill: {kill.where}", flush=True)
            for orphan in kill.orphans:
                print(f"    ! orphan: {orphan}", flush=True)
        for problem in trial.problems:
            print(f"  ! {problem}", flush=True)

    stopped = []
    plan = [(sig, target) for sig in STOP_SIGNALS if sig.name in args.stop_signals for target in signals.TARGETS]
    for p in procs:
        for number in range(args.signals):
            sig, target = plan[number % len(plan)]
            trial = signals.run_signal_trial(f"signal-{number + 1}-p{p}", references[p], sig, target, work, rng, args.keep)
            stopped.append(trial)
            print(f"\n{trial.name}: {sig.name} to the {target} after step {trial.at_step}: exit {trial.status}, saved "
                  f"step {trial.saved}, lost {trial.lost_steps}, traceback {_yes(trial.console_traceback)}, "
                  f"bit-identical {_yes(trial.identical)}", flush=True)
            for problem in trial.problems:
                print(f"  ! {problem}", flush=True)

    damaged = []
    for case in cases:
        result = damage.run_case(case, references[procs[0]], work, rng, args.keep)
        damaged.append(result)
        print(f"\ndamage {case} ({result.file}): exit {result.status}, detected {_yes(result.detected)}, "
              f"fell back {_yes(result.fell_back)}", flush=True)
        for problem in result.problems:
            print(f"  ! {problem}", flush=True)

    failed_writes = []
    for case in write_cases:
        for p in procs:
            result = writes.run_case(case, references[p], work / f"p{p}", args.keep)
            failed_writes.append(result)
            print(f"\nwrites {case}, {p} process(es): exit {result.status}, said why {_yes(result.said)}, traceback "
                  f"{_yes(result.traceback)}, reference losses {_yes(result.identical)}", flush=True)
            for problem in result.problems:
                print(f"  ! {problem}", flush=True)

    shared = None if args.no_two_runs else two_runs.run_two(references[procs[0]], work, args.keep)
    if shared:
        print(f"\ntwo runs on one folder: exit statuses {shared.statuses}", flush=True)
        for problem in shared.problems:
            print(f"  ! {problem}", flush=True)

    print(f"\n=== tally (seed {args.seed}, {args.steps} steps, a checkpoint every {args.interval}; "
          f"{time.monotonic() - began:.0f} s) ===")
    if trials:
        print(kill_tally(trials, procs))
    if stopped:
        print(f"\nstop signals: {sum(t.passed for t in stopped)}/{len(stopped)} stopped cleanly (exit 128 + signal, no "
              f"traceback, the saved step named, no step lost) and resumed bit-identically; lost steps in all: "
              f"{sum(t.lost_steps for t in stopped)}")
    if damaged:
        print()
        print(damage_tally(damaged))
        print(f"detected with a file named {sum(r.detected for r in damaged)}/{len(damaged)}, "
              f"fell back {sum(r.fell_back for r in damaged)}/{len(damaged)}")
    if failed_writes:
        print(f"\nfailing writes: {sum(r.passed for r in failed_writes)}/{len(failed_writes)} cost only themselves (the "
              "failure said in a line of its own, no traceback, the reference's losses and export)")
    if shared:
        verdict = f"refused in one line: {shared.refused}" if shared.refused else "not refused in one line"
        print(f"\ntwo runs on one folder: {'PASS' if shared.passed else 'FAIL'}: exactly one ran {_yes(shared.one_ran)}, "
              f"{verdict}, winner's files intact {_yes(shared.intact)}")
    if not args.keep:
        for reference in references.values():
            shutil.rmtree(reference.job.dump, ignore_errors=True)
    passed = (all(t.identical and t.export_ok and not t.staging_left and not any(k.orphans for k in t.kills)
                  for t in trials) and all(t.passed for t in stopped)
              and all(r.detected and r.fell_back and r.identical for r in damaged) and all(r.passed for r in failed_writes)
              and (shared is None or shared.passed))
    print(f"\nchaos: {'every check passed' if passed else 'some checks failed (see ! lines above)'}; "
          f"every attempt's output is in {work}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""Fault injection: does a flame run survive being killed, a damaged checkpoint, a second run beside it?

    python -m scripts.chaos --kills 20 --procs 1,2 --seed 0     the full harness (tens of minutes on 2 CPU cores)
    python -m scripts.chaos --short                             2 kills on 1 process, 1 damage case, two runs (minutes)

Everything runs the debug job (configs/debug.toml: a 4M llama on the Python stdlib, on CPU)
through ``bash train.sh`` as a user would, on a short schedule (--steps, a checkpoint every
--interval steps, every step logged), each case in a dump folder of its own under --work:

1. references: the job uninterrupted, once per process count of --procs (NGPU=2 on CPU runs
   two gloo ranks); every other case compares against them, bit for bit.
2. kill trials (kills.py): ``kill -9`` of train.sh's whole process group at seeded moments
   (mid-save, mid-export, random), the same command again until the job finishes; then: no
   process of a killed run left alive, every logged loss equal to the reference's, the HF
   export loads with the reference's weights, no export staging folder left.
3. signal trials (signals.py): SIGTERM, SIGINT, SIGHUP or SIGUSR1 to train.sh's process group (a terminal's
   Ctrl-C, Slurm) or to its launcher alone, at a seeded step; the run must save the step it took,
   exit 128 + signal without a traceback, say how to resume, and resume bit-identically.
4. damage cases (damage.py): the latest step of a finished run's copy damaged, then resumed:
   is the damaged file named, does the run fall back to the previous step and finish with the
   reference's losses?
5. failing writes (writes.py): a full disk at an interval save or at the last save, under
   metrics.jsonl; files where the TensorBoard and trace folders go. A failure costs only itself:
   said in a line of its own, no traceback, the run's losses and export the reference's (a
   failed last save: exit non-zero, nothing exported, and the same command again finishes it).
6. two runs started together on one dump folder (two_runs.py): exactly one may run.

It ends with a tally table and exits 1 if any check failed. tests/launch/test_chaos.py runs the
smallest version of each case in CI.
"""

"""What a run changes with the step: the global batch (--training.batch_ramp), the longest attention span
(--training.context_ramp) and the data mixture (--training.data_phases), parsed once into a ``Curriculum`` that
the planner (flame.prepare.batch), the data shards (flame.data.packing) and the trainer (flame.training.curriculum)
all read. Steps count from 1, like the log's.

    --training.batch_ramp "1: 64, 501: 128, 2001: 256"      rows a step from each step on; the last is the run's
    --training.context_ramp "1: 512, 1001: 2048"             documents cut to at most this many tokens from each step on
    --training.data_phases "2001: 0.2,0.8; 5001: 0,1 reset_optimizer restart_lr"

Before the first data phase, --training.data_probs holds. A phase gives one probability per dataset (0 leaves a
source out) and may reset the optimizer's state and restart the lr schedule (its warmup and decay over the steps
left) at its first step.
"""

from bisect import bisect_right
from dataclasses import dataclass

from flame.base.errors import ConfigError

PHASE_OPTIONS = ("reset_optimizer", "restart_lr")


@dataclass(frozen=True)
class DataPhase:
    start: int  # its first step
    probabilities: tuple[float, ...]
    reset_optimizer: bool = False
    restart_lr: bool = False


@dataclass(frozen=True)
class Curriculum:
    batch: tuple[tuple[int, int], ...] = ()  # (first step, global rows a step), from step 1; () = no ramp
    context: tuple[tuple[int, int], ...] = ()  # (first step, context length), from step 1; () = no ramp
    phases: tuple[DataPhase, ...] = ()

    @classmethod
    def of(cls, training) -> "Curriculum":
        """The curriculum of a job's --training settings (ConfigError in one line for one that does not parse)."""
        return cls(_ramp(training.batch_ramp, "batch_ramp", "rows"), _ramp(training.context_ramp, "context_ramp", "tokens"),
                   _phases(training.data_phases))

    def __bool__(self) -> bool:
        return bool(self.batch or self.context or self.phases)

    def rows(self, step: int, constant: int) -> int:
        """Global rows of ``step`` (``constant`` without a batch ramp)."""
        return _at(self.batch, step, constant)

    def context_len(self, step: int, constant: int) -> int:
        """The longest segment of a document at ``step`` (``constant`` without a context ramp)."""
        return _at(self.context, step, constant)

    def phase(self, step: int) -> int:
        """0 before the first data phase, else the number of the phase ``step`` is in (1 for the first)."""
        return bisect_right([phase.start for phase in self.phases], step)

    def step_of_row(self, row: int, constant: int) -> int:
        """The step whose global batch holds global row ``row`` (from 0) of the run's rows (``constant`` rows a step
        without a batch ramp)."""
        if not self.batch:
            return 1 + row // constant
        taken = 0  # rows of the ramp's earlier entries
        for index, (first, rows) in enumerate(self.batch):
            if index + 1 == len(self.batch) or row < taken + (self.batch[index + 1][0] - first) * rows:
                return first + (row - taken) // rows
            taken += (self.batch[index + 1][0] - first) * rows
        raise AssertionError("the last entry holds every later row")

    def largest_batch(self) -> int | None:
        return max(rows for _, rows in self.batch) if self.batch else None


def _entries(text: str, flag: str, separator: str) -> list[tuple[int, str]]:
    """``"step: value<sep> step: value"`` as (step, value text), steps from 1 and rising."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(separator))):
        step, colon, value = part.partition(":")
        if not colon or not step.strip().isdigit() or not value.strip():
            raise ConfigError(f"--training.{flag}: '{part}' is not 'step: value' (e.g. --training.batch_ramp "
                              "\"1: 64, 501: 128\")")
        entries.append((int(step), value.strip()))
    steps = [step for step, _ in entries]
    if any(step < 1 for step in steps) or steps != sorted(set(steps)):
        raise ConfigError(f"--training.{flag} '{text}': its steps must be >= 1 and rise (steps count from 1)")
    return entries


def _ramp(text: str, flag: str, unit: str) -> tuple[tuple[int, int], ...]:
    entries = _entries(text, flag, ",")
    if not entries:
        return ()
    if entries[0][0] != 1:
        raise ConfigError(f"--training.{flag} starts at step {entries[0][0]}: give the {unit} of step 1 first "
                          f"(e.g. \"1: <{unit}>, {entries[0][0]}: {entries[0][1]}\")")
    ramp = []
    for step, value in entries:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--training.{flag}: {unit} '{value}' at step {step} is not a whole number >= 1")
        ramp.append((step, int(value)))
    return tuple(ramp)


def _phases(text: str) -> tuple[DataPhase, ...]:
    phases = []
    for step, value in _entries(text, "data_phases", ";"):
        probabilities, *options = value.split()
        unknown = [option for option in options if option not in PHASE_OPTIONS]
        if unknown:
            raise ConfigError(f"--training.data_phases: '{unknown[0]}' at step {step} is not an option of a phase: "
                              f"give {' and/or '.join(PHASE_OPTIONS)} after its probabilities")
        try:
            numbers = tuple(float(p) for p in probabilities.split(",") if p.strip())
        except ValueError:
            numbers = ()
        if not numbers or any(not 0 <= p < float("inf") for p in numbers) or not sum(numbers) > 0:
            raise ConfigError(f"--training.data_phases: '{probabilities}' at step {step} is not a comma list of "
                              "probabilities >= 0 with a positive sum, one per dataset")
        if step == 1:
            raise ConfigError("--training.data_phases: a phase from step 1 is the run's mixture: give it as "
                              "--training.data_probs, and the phases from later steps")
        phases.append(DataPhase(step, numbers, "reset_optimizer" in options, "restart_lr" in options))
    return tuple(phases)


def _at(ramp: tuple[tuple[int, int], ...], step: int, constant: int) -> int:
    if not ramp:
        return constant
    return ramp[bisect_right([first for first, _ in ramp], step) - 1][1]

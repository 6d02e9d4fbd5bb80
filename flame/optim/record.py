"""One record per optimizer: everything flame knows about an ``--optimizer.name``, in one place.

Every consumer that depends on the optimizer reads its record, never its name:
- flame.optim.builder builds it (``build``), or steps it on the host (``steps_on_host``, ``decoupled``),
- flame.prepare.settings refuses unknown names, settings of another optimizer (``owns``), bad values of
  its own (``check``), and CPU offload or ``--optimizer.on_host`` where it cannot take them,
- the memory plan counts its state (``state_bytes``, ``matrix_state_bytes``) and offers offload and the
  host step only where it runs under them (flame.memory),
- the update guard lets it skip a non-finite update on the GPU (``skips_on_gpu``; flame.training.update_guard).

Each optimizer's file (adamw.py, muon.py) defines its record and registers it; flame/optim/__init__.py
imports those files, so the registry is complete once anything of flame.optim is imported.
Adding one: flame/optim/README.md.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import ParallelDims

from flame.base.errors import ConfigError

# (model parts, the job's optimizer section, the parallel layout, torchft's manager) -> torchtitan's container
Build = Callable[[list[nn.Module], Any, ParallelDims | None, FTManager | None], OptimizersContainer]


def _never(optimizer_config: Any) -> bool:
    return False


def _nothing_to_check(optimizer_config: Any) -> None:
    return None


@dataclass(frozen=True)
class OptimizerRecord:
    """What flame knows about one optimizer."""

    name: str  # its --optimizer.name
    summary: str  # one line: what it is (docs, the registry's listing)
    takes: str  # which parameters it steps and how, in words (docs)
    build: Build  # torchtitan's OptimizersContainer over the model parts (flame.optim.builder calls it)
    state_bytes: int  # fp32 state a parameter costs (AdamW: two moments, 8 bytes)
    # the state of a parameter of the decoder blocks' matrices, where it differs (Muon: one momentum, 4 bytes);
    # None: state_bytes
    matrix_state_bytes: int | None = None
    state: str = "two moments"  # its state in words (the memory plan's table)
    decoupled: bool = True  # weight decay decoupled from the gradient (AdamW), or added to it (Adam)
    steps_on_host: bool = True  # --optimizer.on_host can step it (flame.optim.host: AdamW's or Adam's update)
    offloads: bool = True  # it runs under --training.enable_cpu_offload (its state and step on the CPU)
    # why it cannot (steps_on_host or offloads False), a clause naming it: the refusals say it
    on_gpu_only: str = ""
    # given the step's ``found_inf``, its step itself skips a non-finite update, on the GPU, under this
    # optimizer section (torch's fused Adam and AdamW do): the update guard then reads norms late
    skips_on_gpu: Callable[[Any], bool] = _never
    owns: tuple[str, ...] = ()  # the config fields only it reads (dotted): setting them for another is refused
    check: Callable[[Any], None] = _nothing_to_check  # refuses its own fields' values (ConfigError), before any rank

    def state_of(self, params: int, matrix_params: int) -> int:
        """Bytes of its state over ``params`` parameters, ``matrix_params`` of them the decoder blocks' matrices."""
        matrix = self.state_bytes if self.matrix_state_bytes is None else self.matrix_state_bytes
        return matrix * matrix_params + self.state_bytes * (params - matrix_params)


# Filled by register(), in the order flame/optim/__init__.py imports the optimizers' files: the first record
# that can take a setting is the one a refusal suggests.
OPTIMIZERS: dict[str, OptimizerRecord] = {}


def register(record: OptimizerRecord) -> OptimizerRecord:
    """Add ``record`` to the registry under its name (one optimizer per name)."""
    if record.name in OPTIMIZERS:
        raise ValueError(f"two optimizers are registered as {record.name}")
    OPTIMIZERS[record.name] = record
    return record


def optimizer_record(name: str) -> OptimizerRecord:
    """The record of ``--optimizer.name`` ``name``; a ConfigError naming the choices for any other name."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"--optimizer.name {name}: flame trains with {', '.join(sorted(OPTIMIZERS))}; "
                          "choose one of them")
    return OPTIMIZERS[name]


def first_that(can: Callable[[OptimizerRecord], bool]) -> OptimizerRecord:
    """The first registered record that ``can``: the one a refusal suggests instead."""
    return next(record for record in OPTIMIZERS.values() if can(record))


def host_step_refusal(name: str, flag: str) -> str | None:
    """Why ``flag`` (a layout that steps the optimizer on the host) cannot step ``--optimizer.name`` ``name``, as a
    one-line remedy; None where it can."""
    record = optimizer_record(name)
    if record.steps_on_host:
        return None
    hosted = first_that(lambda other: other.steps_on_host).name
    names = " or ".join(other.name for other in OPTIMIZERS.values() if other.steps_on_host)
    return (f"{flag} steps {names} on the host; {record.on_gpu_only}: use --optimizer.name {hosted}, or leave "
            f"{flag.rsplit('.', 1)[-1]} off")

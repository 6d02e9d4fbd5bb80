"""flame's checkpoint manager: torchtitan's CheckpointManager, with manifests and damaged steps set aside.

torchtitan's Trainer builds it in place of its own (flame.compat.torchtitan.checkpoints_with_manifests).
What it adds (flame.checkpoint.manifest holds the manifest itself):
- every save records its step's manifest once the save is complete, synchronous or async: each
  rank hashes the files it wrote, in a thread of its own, and rank 0 writes the manifest, with the
  run's identity (``set_identity``, called by the trainer: flame.checkpoint.identity);
- before a load, all ranks check the step against its manifest together (each checksums its
  share): a damaged or incomplete latest step is set aside (``step-N.damaged``) and the newest
  intact one loads; a step named explicitly (``--checkpoint.load_step``,
  ``--checkpoint.initial_load_path``) that fails the check stops the run in one line;
- steps are folders named exactly ``step-N``: set-aside ones are neither loaded nor purged, nor
  are steps still in use (``steps_in_use``: waiting for their background evaluation);
- a save that cannot be written (a full disk) is noted in ``failures`` and training goes on, the
  next interval saving again (flame.checkpoint.save_failures);
- after a load, the optimizers' settings and base lrs are this run's config's again, and the next
  step's lr its schedule's (flame.optim.builder.ConfiguredSettings): a change preflight accepted
  (--checkpoint.accept_changes) applies from the resumed step on, and rank 0 logs it once;
- a model with LoRA adapters is saved under the names flame.models.lora gives (the base weights
  under the plain model's), and a model-only load (step 0, --checkpoint.initial_load_path)
  reads its base weights alone: the adapters keep their init.
"""

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpoint import (
    MODEL,
    LR_SCHEDULER,
    OPTIMIZER,
    CheckpointManager,
    ModelWrapper,
)
from torchtitan.tools.logging import logger

from flame.checkpoint import manifest
from flame.checkpoint.identity import identity
from flame.checkpoint.save_failures import SaveFailures
from flame.checkpoint.steps import (
    EMA_STATE,
    explicit_step_error,
    newest_intact,
    unrecorded_checkpoint_error,
)
from flame.optim.builder import ConfiguredSettings
from flame.optim.host_worker import SettlesFirst
from flame.base.errors import ConfigError
from flame.models import init_from, lora

# How long rank 0 waits for the other ranks' hashes of a step: longer than hashing a rank's
# files takes (and than a shared filesystem takes to show one node's file to another), and it
# bounds the wait of a rank 0 that stops after a peer died.
_PARTS_TIMEOUT = 600.0


def _rank_and_ranks() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class ManifestRecorder:
    """Records each saved step's manifest after its save completes, in order, in a thread of its own.

    Each rank hashes the files it wrote (no rank reads another's) and leaves its share in the
    step folder; rank 0 adds its own, DCP's .metadata included, and writes the manifest. The
    shares travel through the filesystem, which every rank shares already, rather than through
    a process group of their own: no collective runs beside the trainer's.
    """

    def __init__(self):
        self.rank, self.ranks = _rank_and_ranks()
        self.queue: queue.Queue = queue.Queue()
        self.on_recorded: Callable[[str], None] | None = None  # rank 0: told each step whose manifest it wrote
        self.thread = threading.Thread(target=self._run, name="flame-manifests", daemon=True)
        self.thread.start()

    def add(self, folder: str, save: Future | None, identity: dict | None = None) -> None:
        """Record ``folder``'s manifest (with the run's ``identity``) once ``save`` (an async save's future; None:
        done) completes."""
        self.queue.put((folder, save, identity))

    def wait(self) -> None:
        """Until the manifests of the saves so far are recorded (this rank's part of them)."""
        self.queue.join()

    def close(self) -> None:
        """Record the manifests still pending, then stop."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                self._record(*item)
            except Exception as error:  # the thread lives on: wait() must return
                logger.warning(f"{item[0]} gets no {manifest.MANIFEST} ({error}): a run resuming here sets it aside")
            finally:
                self.queue.task_done()

    def _record(self, folder: str, save: Future | None, identity: dict | None) -> None:
        try:
            if save is not None:
                try:
                    save.result()
                except BaseException:  # it failed: the checkpointer says so (FlameCheckpointManager._async_wait)
                    return
            mine = [name for name in manifest.step_files(folder) if manifest.owner(name, self.ranks) == self.rank]
            files = manifest.describe(folder, mine)
            if self.rank != 0:
                manifest.write_part(folder, self.rank, files)
                return
            files |= manifest.collect_parts(folder, range(1, self.ranks), _PARTS_TIMEOUT)
            manifest.write(folder, files, identity)
            if self.on_recorded is not None:  # the step is complete: it loads now (the evaluations wait for this)
                self.on_recorded(folder)
        except Exception as error:
            if self.rank == 0:
                raise
            manifest.write_part(folder, self.rank, None, f"{type(error).__name__}: {error}")  # rank 0 says it


class AdapterCheckpoint(ModelWrapper):
    """torchtitan's ModelWrapper for a model with adapters, under the names checkpoints use (``lora.checkpoint_name``)."""

    def _get_state_dict(self) -> dict[str, Any]:
        state_dict = super()._get_state_dict()
        self.fqns = {lora.checkpoint_name(fqn): fqn for fqn in state_dict}
        return {lora.checkpoint_name(fqn): tensor for fqn, tensor in state_dict.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torchtitan passes the whole flattened checkpoint (optimizer, data loader...): the model's part
        super().load_state_dict({self.fqns[name]: tensor for name, tensor in state_dict.items() if name in self.fqns})

    def base_state_dict(self) -> dict[str, Any]:
        """The frozen weights only: what a model-only load reads (the adapters keep their init)."""
        return {name: tensor for name, tensor in self.state_dict().items() if not lora.is_adapter_weight(name)}


class FlameCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager that records manifests and loads only steps that match theirs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorder = ManifestRecorder() if self.enable and not self.load_only else None
        model_parts = self.states[MODEL].model
        if any(lora.adapted_modules(part) for part in model_parts):
            self.states[MODEL] = AdapterCheckpoint(model_parts)
        self.init_from: str | None = None
        self.identity: dict | None = None  # the run's, recorded with every step (set_identity; None records none)
        # taken before any load replaces them with the saved run's
        self.configured = ConfiguredSettings(self.states[LR_SCHEDULER]) if self.enable else None
        # steps that something still reads (their background evaluation): kept beyond keep_latest_k
        self.steps_in_use: Callable[[], set[int]] = set
        # the trainer's settling of what the train state counts (steps whose update checks were deferred)
        self.before_save: Callable[[], None] = lambda: None
        # saves that could not be written: noted, not fatal (flame.checkpoint.save_failures)
        self.failures = SaveFailures(self.folder, self.interval, *_rank_and_ranks()) if self.recorder else None
        self._background_step: int | None = None  # the step an async save is writing

    def set_identity(self, job_config, tokenizer) -> None:
        """Record the identity of the run of ``job_config`` (flame.checkpoint.identity) with every step saved from now on."""
        self.identity = identity(job_config, tokenizer)

    def start_from(self, folder: str | None) -> None:
        """Load the weights of the Hugging Face model in ``folder`` (--model.init_from) when no checkpoint loads."""
        self.init_from = folder

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only and isinstance(self.states[MODEL], AdapterCheckpoint):
            logger.info("LoRA: a model-only load reads the base weights; the adapters start from their init")
            return self.states[MODEL].base_state_dict()
        return super()._states_to_load(model_only)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode, enable_garbage_collection: bool = False,
                 to_hf: bool = False):
        self.before_save()  # may stop the run: before anything of this step is written
        if isinstance(optimizers := self.states.get(OPTIMIZER), SettlesFirst):
            optimizers.settle()  # --optimizer.on_host, --memory.stream_weights: the step in flight writes the weights
        if self.recorder is None or to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        # One recording at a time (a step can be saved twice in a row, when the data runs out),
        # so that no part of an earlier save is in flight. A step written over (a run resumed
        # from an earlier one) is incomplete until its new manifest: no rank writes a file
        # before every rank has entered DCP's save, rank 0 included.
        self.recorder.wait()
        self.failures.starting(checkpoint_id)
        if _rank_and_ranks()[0] == 0:
            manifest.unmark(checkpoint_id)
        try:
            result = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        except BaseException:  # DCP's CheckpointException is no Exception
            self.failures.writing_failed = True  # only this is a failed save; an error after it is not
            raise
        pending = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        if isinstance(pending, Future):
            self._background_step = int(os.path.basename(checkpoint_id).removeprefix("step-"))
        self.recorder.add(checkpoint_id, pending if isinstance(pending, Future) else None, self.identity)
        return result

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """torchtitan's save, where a failure to write is noted in ``failures`` instead of ending the run."""
        if self.failures is not None:
            self.failures.writing_failed = False
        try:
            super().save(curr_step, last_step)
        except BaseException as error:
            if (self.failures is None or not self.failures.writing_failed
                    or not self.failures.record(curr_step, error, interval_save=not last_step)):
                raise

    def _async_wait(self) -> None:
        """torchtitan's wait for the async save in flight, where a failure to write is noted like a sync save's."""
        try:
            super()._async_wait()
        except BaseException as error:
            step, self._background_step, self.save_future = self._background_step, None, None
            if step is None or not self.failures.record(step, error, interval_save=True, background=True):
                raise

    def load(self, step: int = -1) -> bool:
        if self.enable:
            if step != -1 or os.path.exists(self.folder):  # a step named explicitly must be there
                step = self._verified_step(step)
            elif self.initial_load_path:
                if found := self._defect(self.initial_load_path):
                    raise ConfigError(unrecorded_checkpoint_error("--checkpoint.initial_load_path", self.initial_load_path, found))
        loaded = super().load(step)
        if loaded and self.configured is not None:
            changed = self.configured.restore(self.states[LR_SCHEDULER])
            if changed and _rank_and_ranks()[0] == 0:
                logger.info(f"resumed with this run's optimizer settings where they differ from the checkpoint's: {', '.join(changed)}")
        if not self.init_from:
            return loaded
        if loaded:  # (--checkpoint.initial_load_path is refused beside init_from: a step of this run loaded)
            logger.info(f"{init_from.FLAG} {self.init_from} is not applied: this run resumes from its own checkpoint in {self.folder}")
            return loaded
        logger.info(f"{init_from.FLAG}: loading the weights of {self.init_from} (model only)")
        begin = time.monotonic()
        # the model's weights under the names the files use (with LoRA, the base weights alone)
        states = self._states_to_load(model_only=True)
        init_from.load(self.init_from, states)
        self.states[MODEL].load_state_dict(states)  # as torchtitan's dcp_load does after its dcp.load
        logger.info(f"{init_from.FLAG}: loaded in {time.monotonic() - begin:.2f} seconds")
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's load, where a checkpoint saved without the weights' average (--training.ema_decay turned on
        for the resume) starts it from the loaded weights instead of failing on its missing entries."""
        average = self.states.get(EMA_STATE)
        starts_average = (average is not None and EMA_STATE in state_dict and not from_hf
                          and not _holds(checkpoint_id, f"{EMA_STATE}."))
        if starts_average:
            state_dict = {key: value for key, value in state_dict.items() if key != EMA_STATE}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if starts_average:
            average.restart()
            logger.info(f"--training.ema_decay: {checkpoint_id} holds no average of the weights; it starts at the "
                        "loaded weights")

    def _find_load_step(self, folder: str = "") -> int:
        steps = manifest.complete_steps(folder or self.folder)
        return steps[-1] if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        # only folders named exactly step-N count (torchtitan's would count and delete step-N.damaged)
        if self.keep_latest_k > 0 and _rank_and_ranks()[0] == 0:
            steps, in_use = manifest.step_folders(self.folder), self.steps_in_use()
            for step in sorted(steps)[: -self.keep_latest_k]:
                if step in in_use:  # purged at a later save, once its evaluation has read it
                    logger.info(f"--checkpoint.keep_latest_k: step {step} stays until its evaluation ends")
                    continue
                self.purge_queue.put(steps[step])

    def close(self) -> None:
        if getattr(self, "recorder", None) is not None:
            self.recorder.close()
            self.recorder = None
        super().close()

    def _defect(self, folder: str) -> manifest.Defect | None:
        """What is wrong with a step, checked by all ranks together: each checksums the files of its rank."""
        rank, ranks = _rank_and_ranks()
        mine = [name for name in manifest.step_files(folder) if manifest.owner(name, ranks) == rank]
        found = [manifest.defect(folder, checksums=mine)]
        if ranks > 1:
            gathered = [None] * ranks
            dist.all_gather_object(gathered, found[0])
            found = gathered
        return next((defect for defect in found if defect is not None), None)

    def _verified_step(self, step: int) -> int:
        """The step to load (-1: none): ``step`` when given and intact, else the newest intact step."""
        if step != -1:
            path = os.path.join(self.folder, f"step-{step}")
            found = self._defect(path) if os.path.isdir(path) else None
            if found or not os.path.isdir(path):
                raise ConfigError(explicit_step_error(self.folder, step, found))
            return step
        rank, ranks = _rank_and_ranks()
        steps = [manifest.step_folders(self.folder) if rank == 0 else None]
        if ranks > 1:  # one listing: rank 0 renames folders while the others look
            dist.broadcast_object_list(steps, src=0)
        steps = steps[0]
        chosen = newest_intact(steps, self._defect, logger.warning if rank == 0 else None)
        if ranks > 1:
            dist.barrier()  # rank 0's last rename is done before any rank lists the folder
        return next((step for step, path in steps.items() if path == chosen), -1)


def _holds(checkpoint_id: str, prefix: str) -> bool:
    """Whether the DCP checkpoint ``checkpoint_id`` has entries whose names start with ``prefix``."""
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    return any(name.startswith(prefix) for name in metadata.state_dict_metadata)

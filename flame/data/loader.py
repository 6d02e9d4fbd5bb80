"""The per-rank data loader: logical data shards -> batches, with exact and elastic resume.

Each (data-parallel rank, worker role) pair is a *reader*; reader ``r`` of ``R`` serves the
logical shards r, r+R, r+2R, ... (flame.data.shards) and builds each batch from rows of its
shards in turn. Every batch carries the positional states its shards reached, so the main
process always knows exactly how far each shard got in what was delivered, whatever the
workers have prefetched. A checkpoint stores these states for all shards of all ranks in
one entry that every rank writes identically, as JSON (a checkpoint's data state is read
without unpickling anything of flame's); on resume:

- same layout (ranks x workers): every reader continues with its shards and its turn
  order, and worker roles rotate so the next batch comes from the reader that would have
  produced it: the batches are exactly those of an uninterrupted run;
- another layout: the shards are dealt to the new readers and each continues from its own
  state: the same global stream, no document repeated or skipped (batches are composed
  differently).
"""

import functools
import json
import os
import signal
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from flame.data.packing import ROW_COUNTERS, collate_rows
from flame.data.shards import DataPlan, DataShard, shards_of_reader
from flame.data.streams import SourceExhausted
from flame.base.errors import ConfigError, DataError
from flame.base.process import die_with_parent, ignore_stop_signals

# Workers fork after the tokenizer is loaded; Rust-side threads do not survive a fork.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STATE_VERSION = 2  # JSON (version 1, a pickle, is not loaded)


def _to_json(value: Any) -> str:
    # numpy scalars (positions computed with numpy) become Python numbers; anything else not JSON fails here
    return json.dumps(value, default=lambda v: v.item() if isinstance(v, np.generic) else _not_json(v))


def _not_json(value: Any):
    raise TypeError(f"data loader state holds a {type(value).__name__}, which JSON cannot store")


def _by_int(mapping: dict[str, Any]) -> dict[int, Any]:
    """A JSON object's keys (shard, rank or role numbers: strings in JSON) as ints."""
    return {int(key): value for key, value in mapping.items()}


class PackedDataset(IterableDataset):
    """Batches of one data-parallel rank: ``(inputs, labels, progress)``, made by its worker roles."""

    def __init__(self, plan: DataPlan, dp_rank: int, dp_world_size: int, workers: int = 1):
        self.plan, self.dp_rank, self.dp_world_size, self.workers = plan, dp_rank, dp_world_size, max(1, workers)
        self.shards = plan.shards or plan.default_shards(self.readers)
        self.shard_states: dict[int, dict] = {}  # where shards continue from (all shards of the run)
        self.cursors: dict[int, int] = {}  # role -> rows made so far (whose shard is next)
        self.role_offset = 0  # worker w plays role (w + role_offset) % workers
        self.rows_before = 0  # global rows read before the cursors started (a resume that composed batches anew)

    @property
    def readers(self) -> int:
        return self.dp_world_size * self.workers

    def rank_shards(self) -> list[int]:
        """The shards this rank's readers serve under the current layout."""
        first = self.dp_rank * self.workers
        return [s for role in range(self.workers) for s in shards_of_reader(first + role, self.readers, self.shards)]

    def __iter__(self):
        worker = get_worker_info()
        role = ((worker.id if worker else 0) + self.role_offset) % self.workers
        mine = shards_of_reader(self.dp_rank * self.workers + role, self.readers, self.shards)
        pipelines = {}
        for shard in mine:
            pipelines[shard] = DataShard(self.plan, shard, self.shards)
            if shard in self.shard_states:
                pipelines[shard].load_state_dict(self.shard_states[shard])
        cursor = self.cursors.get(role, 0)
        while True:
            rows, touched = [], []
            step = self.step_of_batch(cursor, role)
            for _ in range(self.plan.batch_size):
                shard = mine[cursor % len(mine)]
                try:
                    rows.append(pipelines[shard].next_row(step))
                except SourceExhausted as exhausted:
                    logger.info(f"dataset {exhausted} ran out (--training.source_exhausted stop)")
                    return
                except DataError as error:  # handed over as data: a worker's exception would arrive as a traceback
                    yield None, None, {"error": str(error)}
                    return
                cursor += 1
                touched.append(shard)
            progress = {
                "role": role,
                "cursor": cursor,
                # JSON here too, so that the states held between checkpoints are those a resume reads
                "shard_states": _to_json({shard: pipelines[shard].state_dict() for shard in set(touched)}),
                "counts": {name: np.sum([getattr(row, f"source_{name}") for row in rows], axis=0)
                           for name in ROW_COUNTERS},
            }
            yield (*collate_rows(rows), progress)


    def step_of_batch(self, cursor: int, role: int) -> int | None:
        """The step that trains role ``role``'s next batch, its rows made so far ``cursor`` (None without a curriculum).

        Role r makes this rank's batches r, r + workers, ... (counted since the cursors started), and every rank's
        k-th batch holds the global rows after k x ranks x batch_size of them.
        """
        plan = self.plan
        if not plan.curriculum:
            return None
        batch = cursor // plan.batch_size * self.workers + role
        return plan.curriculum.step_of_row(self.rows_before + batch * self.dp_world_size * plan.batch_size,
                                           plan.global_rows)


def _end_with_rank(rank_pid: int, worker_id: int) -> None:
    die_with_parent(signal.SIGKILL, parent=rank_pid)
    ignore_stop_signals()  # the rank stops on them after its step, which needs its workers' batches


class FlameDataLoader(BaseDataLoader):
    """torchtitan's dataloader protocol over PackedDataset: iterate batches, save and load state."""

    def __init__(self, plan: DataPlan, dp_rank: int, dp_world_size: int, loader_config):
        self.dataset = PackedDataset(plan, dp_rank, dp_world_size, loader_config.num_workers)
        self.dp_rank = dp_rank
        self.loader_options = {"batch_size": None, "num_workers": loader_config.num_workers,
                               "pin_memory": loader_config.pin_memory}
        if loader_config.num_workers > 0:
            # workers end with their rank at once (torch's own check of the parent takes seconds)
            self.loader_options |= {"persistent_workers": loader_config.persistent_workers,
                                    "prefetch_factor": loader_config.prefetch_factor,
                                    "worker_init_fn": functools.partial(_end_with_rank, os.getpid())}
        self.batches = 0  # batches this rank delivered (since the run started)
        # per source, what this rank's batches held since the run started (flame.data.packing.Row's counters)
        self.counts = {name: np.zeros(len(plan.specs), dtype=np.int64) for name in ROW_COUNTERS}

    def __iter__(self):
        dataset = self.dataset
        shards_of_reader(0, dataset.readers, dataset.shards)  # a layout that cannot read fails here
        dataset.plan.warn_about_stream_splitting(dataset.shards)
        if self.dp_rank == 0:
            plan = dataset.plan
            mixing = f", mixed {plan.probabilities} by {plan.mix_unit}" if len(plan.specs) > 1 else ""
            logger.info(
                f"Data: {dataset.shards} data shards over {dataset.dp_world_size} ranks x {dataset.workers} "
                f"worker roles{mixing}"
            )
        for inputs, labels, progress in DataLoader(dataset, **self.loader_options):
            if "error" in progress:
                raise DataError(progress["error"])
            self.batches += 1
            dataset.shard_states.update(_by_int(json.loads(progress["shard_states"])))
            dataset.cursors[int(progress["role"])] = int(progress["cursor"])
            for name, count in progress["counts"].items():
                self.counts[name] += np.asarray(count)
            yield inputs, labels

    def local_state(self) -> tuple[int, dict]:
        """(data-parallel rank, what this rank knows): one rank's part of the checkpoint entry."""
        # Only this rank's shards: after a resume every rank also holds the others' (stale) states.
        states = self.dataset.shard_states
        return self.dp_rank, {
            "cursors": dict(self.dataset.cursors),
            "batches": self.batches,
            "shard_states": {shard: states[shard] for shard in self.dataset.rank_shards() if shard in states},
            **{f"source_{name}": count.tolist() for name, count in self.counts.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        # Every rank contributes its shards; every rank then holds (and writes) the same entry.
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, self.local_state())
        else:
            gathered = [self.local_state()]
        return self.checkpoint_entry(gathered)

    def checkpoint_entry(self, gathered: list[tuple[int, dict]]) -> dict[str, Any]:
        """The checkpoint entry made of every data-parallel rank's local_state()."""
        ranks = dict(gathered)
        dataset = self.dataset
        shard_states = {shard: state for _, rank in sorted(ranks.items()) for shard, state in rank["shard_states"].items()}
        state = {
            "version": STATE_VERSION,
            "sources": [spec.path for spec in dataset.plan.specs],
            "shards": dataset.shards,
            "layout": [dataset.dp_world_size, dataset.workers],
            "rows_before": dataset.rows_before,
            "shard_states": shard_states,
            "ranks": {rank: {k: v for k, v in s.items() if k != "shard_states"} for rank, s in ranks.items()},
        }
        return {"state": _to_json(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        try:
            if isinstance(state_dict.get("state"), bytes):
                raise ValueError("it is a pickle, which flame does not load: a pickle can run code")
            state = json.loads(state_dict["state"])
            if state["version"] != STATE_VERSION:
                raise ValueError(f"version {state['version']}, expected {STATE_VERSION}")
            state["shard_states"], state["ranks"] = _by_int(state["shard_states"]), _by_int(state["ranks"])
            for rank in state["ranks"].values():
                rank["cursors"] = _by_int(rank["cursors"])
        except Exception as error:
            raise ConfigError(
                f"data loader state in the checkpoint is unreadable on data-parallel rank {self.dp_rank} ({error}); "
                "to start the data from scratch instead, pass --checkpoint.exclude_from_loading dataloader"
            ) from None
        dataset = self.dataset
        sources = [spec.path for spec in dataset.plan.specs]
        if state["sources"] != sources:
            raise ConfigError(
                f"the checkpoint's data sources {state['sources']} are not this run's {sources}; to start the data "
                "from scratch, pass --checkpoint.exclude_from_loading dataloader"
            )
        if dataset.plan.shards and dataset.plan.shards != state["shards"]:
            raise ConfigError(
                f"--training.data_shards {dataset.plan.shards} but the run was started with {state['shards']}: "
                "the number of data shards is fixed for a run; leave it at 0 (or the run's value)"
            )
        dataset.shards = state["shards"]
        dataset.shard_states = state["shard_states"]
        dataset.rows_before = state.get("rows_before", 0)
        ranks = state["ranks"]
        if state["layout"] == [dataset.dp_world_size, dataset.workers]:
            mine = ranks[self.dp_rank]
            dataset.cursors, self.batches = dict(mine["cursors"]), mine["batches"]
            dataset.role_offset = self.batches % dataset.workers
            self._load_counts([mine])
            return
        saved_ranks, saved_workers = state["layout"]
        rows_read = dataset.rows_before + sum(sum(rank["cursors"].values()) for rank in ranks.values())
        continued = self._continue_in_this_layout(rows_read)
        logger.info(
            f"data: resuming {dataset.shards} data shards saved by {saved_ranks} ranks x {saved_workers} workers "
            f"on {dataset.dp_world_size} ranks x {dataset.workers} workers (same stream, "
            f"{'each step the rows an uninterrupted run would have' if continued else 'batches composed anew'})"
        )
        self._load_counts(list(ranks.values()) if self.dp_rank == 0 else [])  # the run's totals go on in rank 0's

    def _continue_in_this_layout(self, rows_read: int) -> bool:
        """Place every worker role where a run in this layout would be after ``rows_read`` rows in all.

        A reader takes its batch's rows from its shards in turn, and the shards are dealt round-robin, so the rows
        of a step, over all ranks, come from the same shards in any layout whose readers divide the shard count:
        with the saved shard states, the roles' cursors and the next role's turn are all a resume needs to give each
        step the rows of an uninterrupted run (same global batch, the loss within summation order). Where
        ``rows_read`` is not whole batches of this layout, batches are composed anew (False).
        """
        dataset, rows = self.dataset, self.dataset.plan.batch_size
        per_step = dataset.dp_world_size * rows
        if rows_read % per_step or dataset.shards % dataset.readers:
            dataset.cursors, dataset.role_offset, self.batches, dataset.rows_before = {}, 0, 0, rows_read
            return False
        dataset.rows_before = 0
        self.batches = rows_read // per_step  # batches each rank would have delivered
        dataset.cursors = {role: (self.batches - role + dataset.workers - 1) // dataset.workers * rows
                           for role in range(dataset.workers)}
        dataset.role_offset = self.batches % dataset.workers
        return True

    def _load_counts(self, ranks: list[dict]) -> None:
        """The counters as the sum over ``ranks``' saved ones (a counter a checkpoint lacks starts at 0)."""
        for name, count in self.counts.items():
            count[:] = sum((np.asarray(r.get(f"source_{name}", 0), dtype=np.int64) for r in ranks), start=0)


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> FlameDataLoader:
    """torchtitan TrainSpec hook: the loader for one data-parallel rank."""
    plan = DataPlan.from_config(job_config, tokenizer)
    loader_config = job_config.training.dataloader
    logger.info(
        f"Data: {', '.join(spec.path for spec in plan.specs)} ({'streaming' if plan.streaming else 'map-style'}), "
        f"rows of {plan.seq_len} tokens, segments <= {plan.context_len}, {loader_config.num_workers} workers"
    )
    return FlameDataLoader(plan, dp_rank, dp_world_size, loader_config)

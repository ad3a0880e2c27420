"""Host snapshots of the protected state in shared memory, and the log of batches beside them.

:class:`SnapshotManager` speaks orbax's verbs: ``should_save``, ``save_async``, ``wait``,
``latest_step``, ``restore`` -- and ``confirm``: a snapshot's copy runs beside the next step,
and damage to the state it reads may land before or during the copy; the next step reads the
same slot and checks every chunk's digest, so a snapshot is marked complete only once that
step has committed (else it is taken again at the next step).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

import pimhbm
from pimhbm.backup import HostBackup, TensorSpec, specs_of
from pimhbm.recovery.events import RunStats
from pimhbm.recovery.layout import StateLayout
from pimhbm.recovery.programs import Compiler
from pimhbm.recovery.summary import decode_scrub
from pimhbm.recovery.traced import TrainState, slot_of
from pimhbm.update import tensor_dtype

log = logging.getLogger(__name__)


def snapshot_specs(params: Any, layout: StateLayout) -> list[TensorSpec]:
    """What a snapshot holds, in the order the snapshot op writes it: whole tensors and their
    digest tables (a sharded tensor's table holds its shards' tables in order)."""
    specs = []
    for path, p, n, sharded in zip(layout.paths, jax.tree.leaves(params), layout.sizes,
                                   layout.sharded):
        chunks = -(-n // layout.chunk_elems) * (layout.shard if sharded else 1)
        for k in layout.names:
            specs.append(TensorSpec(f"{path}/{k}", tuple(p.shape),
                                    np.dtype(tensor_dtype(k, p.dtype)).name))
            specs.append(TensorSpec(f"{path}/{k}#digests", (chunks, 2), "uint32", True))
    return specs


class InFlight(NamedTuple):
    slot: int
    step: int
    tickets: list[jax.Array]  # one per writer: ready once its copies were issued
    committed: int  # the last of the snapshot's step and the one after it known to commit


class SnapshotManager:
    """Snapshots every ``every`` steps (0: never) into ``backup`` (None: no snapshots).

    The loop's host never waits for a snapshot in the steady state: a copy's verdicts are
    recorded as they come, and once its step and the next have committed and its copies are
    done (asked, not waited for, at each verdict) the slot is sealed on a thread of its own
    (its MAC reads megabytes of digest tables). A step that does not commit is a fault: there
    the copy is waited for, so that its slot can be written again."""

    def __init__(self, backup: HostBackup | None, every: int, compiler: Compiler):
        self.backup, self.every, self.compiler = backup, every, compiler
        self._in_flight: InFlight | None = None
        self._due = False  # a snapshot was dropped: take one at the next step
        self._sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pimhbm-seal")
        # A slot being sealed, and the statistics that count it once it is.
        self._sealing: tuple[concurrent.futures.Future, RunStats] | None = None

    @property
    def enabled(self) -> bool:
        return self.backup is not None

    def latest_step(self) -> int | None:
        """The step of the newest complete snapshot."""
        self._join_seal()
        newest = self.backup.newest() if self.backup is not None else []
        return newest[0][0] if newest else None

    def should_save(self, step: int) -> bool:
        return (self.backup is not None and self._in_flight is None and bool(self.every) and
                (step % self.every == 0 or self._due))

    def save_async(self, state: TrainState, step: int) -> None:
        """Starts copying the state (after ``step``) into the older slot; this process's
        writers write their shards (one program each)."""
        self._due = False
        self._join_seal()
        self.backup.wait_pinned()  # a reopened region is pinned in the background
        slot = self.backup.slot_for_next()
        self.backup.begin(slot, step)
        placement, tickets = self.compiler.placement, []
        for part, device in placement.writers.items():
            program = self.compiler.programs.snapshot[slot_of(state.opt), slot, part]
            tickets.append(program(placement.on_device(state.opt, device)))
            placement.settle(tickets[-1])
        self._in_flight = InFlight(slot, step, tickets, step - 1)

    def save_now(self, state: TrainState, step: int, stats: RunStats) -> None:
        """A snapshot of a state nothing runs beside (the starting state), complete at once."""
        self.save_async(state, step)
        flight = self._wait()
        self._complete(flight.slot, stats)

    def wait(self) -> None:
        """Returns once the copies to the host in flight, and a slot being sealed, are done."""
        self._wait()
        self._join_seal()

    def close(self) -> None:
        """Waits as :meth:`wait`, then lets the sealing thread go."""
        self.wait()
        self._sealer.shutdown()

    def _wait(self) -> InFlight | None:
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            jax.block_until_ready(flight.tickets)
            pimhbm._core.snapshot_wait()
        return flight

    def _copied(self, flight: InFlight) -> bool:
        """Whether the copies of ``flight`` are done (asked, not waited for)."""
        return all(t.is_ready() for t in flight.tickets) and not pimhbm._core.snapshot_pending()

    def _complete(self, slot: int, stats: RunStats) -> None:
        self.backup.complete(slot)
        self._sealed(slot, stats)

    def _sealed(self, slot: int, stats: RunStats) -> None:
        stats.snapshots += 1
        log.info("/%s: the snapshot in slot %d is complete and trusted", self.backup.name, slot)

    def _join_seal(self) -> None:
        """Waits for a slot being sealed, and counts it."""
        sealing, self._sealing = self._sealing, None
        if sealing is not None:
            future, stats = sealing
            self._sealed(future.result(), stats)

    def _seal_in_background(self, slot: int, stats: RunStats) -> None:
        def seal() -> int:
            self.backup.complete(slot)
            return slot
        self._join_seal()
        self._sealing = (self._sealer.submit(seal), stats)

    def confirm(self, step: int, committed: bool, stats: RunStats) -> None:
        """The verdict of ``step`` is known: a snapshot of it becomes trusted once the step
        after it commits (and its copies are done); one whose step or successor did not commit
        is taken again."""
        if self._sealing is not None and self._sealing[0].done():
            self._join_seal()
        flight = self._in_flight
        if flight is None or step not in (flight.step, flight.step + 1):
            return
        if not committed:
            self._wait()  # the copy is done before the slot is written again
            self._due = True
            return
        self._in_flight = flight._replace(committed=step)
        if step == flight.step + 1 and self._copied(flight):
            self._in_flight = None
            self._seal_in_background(flight.slot, stats)

    def dropped(self) -> None:
        """A step was skipped: a snapshot in flight (of a later step) is not kept; the next
        step takes one."""
        if self._wait() is not None:
            self._due = True

    def finish(self, current_verifies: Callable[[], bool], stats: RunStats) -> None:
        """The end of a run: the last snapshot -- sealed once its copies are done if the step
        after it committed, else checked by a scrub (no step after it)."""
        self._join_seal()
        flight = self._wait()
        if flight is not None and (flight.committed == flight.step + 1 or
                                   (flight.committed == flight.step and current_verifies())):
            self._complete(flight.slot, stats)
        self._due = False  # each run starts afresh

    def reset(self) -> None:
        """A new run (the backup rebound to it: every snapshot and logged batch forgotten)."""
        self._wait()
        self._join_seal()
        self._in_flight, self._due = None, False

    def restore(self, treedef: Any) -> tuple[TrainState, int]:
        """The newest snapshot that verifies (its MAC in the region, then its tensors against
        its digest tables on the devices), put into every copy of the state, and its step.
        Raises, saying what was wrong, when none does."""
        self._join_seal()
        self.backup.check_header()
        problems = []
        for step, slot in self.backup.newest():
            if not self.backup.verified(slot):
                problems.append(f"the snapshot of step {step} fails its check (its header or "
                                "digest tables were changed)")
                log.warning("/%s: %s: not used", self.backup.name, problems[-1])
                continue
            state = self._load(slot, step, treedef)
            scrub = self.compiler.placement.fetch(self.compiler.scrub(0)(state))
            self.backup.pin_rest_in_background()  # the puts are done (the scrub read them)
            if not decode_scrub(scrub):
                return state, step
            problems.append(f"the snapshot of step {step} does not match its digests")
            log.warning("/%s: %s: not used", self.backup.name, problems[-1])
        raise RuntimeError("no host snapshot verifies: cannot restore (" +
                           ("; ".join(problems) or "none is complete") + ")")

    def _load(self, slot: int, step: int, treedef: Any) -> TrainState:
        """Each process puts the parts its devices hold, once; the rest of the state (two
        slots: the other slot and the device copy; one copy: the parity) is made from them on
        the devices."""
        placement, layout = self.compiler.placement, self.compiler.t.layout
        views = iter(self.backup.snapshot_arrays(slot))
        leaves = []
        for spec in self.compiler.t.leaf_specs:
            where = placement.sharding(spec)
            leaves.append({k: tuple(placement.put(next(views), where, copy=True) for _ in (0, 1))
                           for k in layout.names})
        traced = self.compiler.t
        return traced.fresh(traced.restored(leaves, step, placement.put, self.compiler.clone()))


class BatchLog:
    """Each step's batch, logged so that a replay uses exactly the data the step first ran on:
    in the shared-memory region when there is one (also for a replay after a crash), else in a
    ring of the same depth in this process's memory. ``batch_fn`` is asked for a step's batch
    once: the sample made at construction is step 1's, and a replay reads the log -- a data
    source that is an iterator loses nothing and is never asked twice."""

    def __init__(self, backup: HostBackup | None, batch_fn: Callable[[int], dict],
                 keys: list[str], first: dict | None, depth: int):
        self.backup, self.batch_fn, self.keys, self.depth = backup, batch_fn, keys, depth
        self.first = None if first is None else [np.asarray(first[k]) for k in keys]
        self.ring: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        # Steps up to here have been asked of batch_fn (step 1's batch is the sample, if any).
        self.made = 0 if self.first is None else 1

    def batch(self, step: int) -> list[np.ndarray]:
        logged = self._logged(step)
        if logged is None:
            logged = self.first if step == 1 and self.first is not None else self._make(step)
            self._log(step, logged)
        return logged

    def _logged(self, step: int) -> list[np.ndarray] | None:
        if self.backup is not None:
            return self.backup.logged_batch(step)
        return self.ring.get(step)

    def _make(self, step: int) -> list[np.ndarray]:
        if step <= self.made and self.backup is None:
            raise RuntimeError(
                f"the batch of step {step} is needed again but the batch log (the last "
                f"{self.depth} steps) no longer holds it, and the data source is not asked twice: "
                "make the Trainer with a larger log_ring")
        if step <= self.made:  # its record in the region failed its check (logged_batch says)
            log.warning("asking batch_fn again for step %d: its logged record is gone", step)
        arrays = self.batch_fn(step)
        self.made = max(self.made, step)
        return [np.asarray(arrays[k]) for k in self.keys]

    def _log(self, step: int, arrays: list[np.ndarray]) -> None:
        if self.backup is not None:
            self.backup.log_batch(step, arrays)
            return
        self.ring[step] = arrays
        while len(self.ring) > self.depth:
            self.ring.popitem(last=False)

    def reset(self) -> None:
        """A new run (Trainer.restart): the log starts over; step 1's batch is the sample still."""
        self.ring.clear()
        self.made = 0 if self.first is None else 1


def sample_batch(sample: dict[str, np.ndarray],
                 devices: int) -> tuple[list[str], list[TensorSpec], dict]:
    """The batch's keys and shapes, checked to split over the devices, and the sample."""
    for k, v in sample.items():
        if v.ndim == 0 or v.shape[0] % devices:
            raise ValueError(f"batch array {k!r} of shape {v.shape}: its first dimension must "
                             f"split evenly over {devices} devices")
    keys = sorted(sample)
    return keys, specs_of((k, sample[k]) for k in keys), sample


def _raw(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1)


def _leaf_bytes(x: Any) -> list[np.ndarray]:
    """A leaf's bytes on this host: the whole array, or the parts this process holds."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return [_raw(s.data) for s in x.addressable_shards]
    return [_raw(x)]


def _describe(value: Any) -> Any:
    """A JSON-able description of a configuration value, the same in every process."""
    if callable(value):
        return f"callable {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


# Options that change no state a run holds: a region written with either setting serves.
# Where non-finite gradients and damaged parameter chunks are found (pimhbm.inplace).
_NOT_BINDING = {"gradient_checks", "parameter_checks"}


def run_binding(params: Any, opt: Any, layout: StateLayout, specs: list[TensorSpec],
                first_batch: dict, run_id: str | None) -> bytes:
    """What makes a run this run, for its backup's header: the model's structure, the
    optimizer's configuration, the layout, the initial parameters, the first batch and the
    caller's ``run_id``. A region written by a run that differs in any of them is refused."""
    config = {"layout": [layout.paths, layout.names, layout.sizes, layout.sharded,
                         layout.chunk_elems, layout.shard],
              "optimizer": {f.name: _describe(getattr(opt, f.name))
                            for f in dataclasses.fields(opt) if f.name not in _NOT_BINDING},
              "specs": [[t.name, list(t.shape), t.dtype] for t in specs],
              "structure": str(jax.tree.structure(params)), "run_id": run_id}
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for leaf in jax.tree.leaves(params):
        for part in _leaf_bytes(leaf):
            h.update(part)
    for k in sorted(first_batch):
        h.update(k.encode())
        h.update(_raw(first_batch[k]))
    return h.digest()

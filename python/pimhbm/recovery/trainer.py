"""The Trainer: protected training, each step's faults handled one step later.

The loop (recovery/loop.py) dispatches a step, keeps up to ``in_flight`` (two) in flight, and
reads each one's summary once the next is queued (the host never waits for the device in the steady state). A committed step is
counted; a skipped one -- and every step halted behind it -- is decoded into a fault report,
repaired (pimhbm.recovery.repairs; the host snapshot when the devices hold no intact copy) and
replayed from the batch log. See ARCHITECTURE.md for the path of a step, a fault and a replay.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable

import jax
import numpy as np

import pimhbm
from pimhbm import inplace
from pimhbm._ffi import ensure_registered
from pimhbm.faults import NO_GRADIENT_FAULT, GradientFault
from pimhbm.backup import HostBackup
from pimhbm.recovery.events import Action, DeviceFailure, RunStats
from pimhbm.recovery.feed import BatchFeed
from pimhbm.recovery.handling import FaultHandling, InFlight
from pimhbm.recovery.health import HealthWatch
from pimhbm.recovery.injection import inject
from pimhbm.recovery.layout import StateLayout
from pimhbm.recovery.loop import RunLoop
from pimhbm.recovery.one_copy import OneCopy
from pimhbm.recovery.placement import Placement, Transport, fsdp_spec, repeatable
from pimhbm.recovery.programs import CompileCounter, Compiler, prewarm
from pimhbm.recovery.repairs import Repairer
from pimhbm.recovery.snapshots import (BatchLog, SnapshotManager, run_binding, sample_batch,
                                       snapshot_specs)
from pimhbm.recovery.traced import slot_of
from pimhbm.recovery.two_slots import TwoSlots
from pimhbm.recovery.transports import transport_for
from pimhbm.update import AdamW

_TRAINERS = itertools.count()  # numbers each Trainer of a process (its IPC keys)


def _transport(name: str) -> Transport:
    try:
        return Transport(name)
    except ValueError:
        raise ValueError(f"replica_transport must be 'collective', 'peer' or 'ipc', got "
                         f"{name!r}") from None


def _check_options(opt: AdamW | inplace.AdamW, transport: Transport, devices: list, shard: int,
                   max_skips: int, multiprocess: bool, *, snapshots: bool) -> None:
    if not isinstance(opt, (AdamW, inplace.AdamW)):
        raise TypeError(f"the Trainer takes pimhbm.adamw(...) (one copy) or "
                        f"pimhbm.update.adamw(...) (two slots), got {type(opt).__name__}")
    if getattr(opt, "gradient_checks", None) is inplace.GradientChecks.IN_UPDATE and not snapshots:
        raise ValueError("gradient_checks=GradientChecks.IN_UPDATE applies a step with a "
                         "non-finite gradient in part (and parameter_checks=ParameterChecks."
                         "IN_UPDATE one with a damaged parameter), and the state then comes "
                         "back from the host snapshot: pass shm_name= and snapshot_every > 0")
    if max_skips < 2:
        raise ValueError(f"max_skips={max_skips}: a step must be allowed at least one replay")
    if shard < 1 or len(devices) % shard:
        raise ValueError(f"shard={shard} must divide the {len(devices)} devices")
    if shard > 1 and getattr(opt, "gradient_transform", None) is not None:
        raise ValueError("gradient_transform sees each device's own shards under FSDP (a global "
                         f"norm would be a shard's): not supported with shard={shard}")
    local = opt.group > 0 if isinstance(opt, inplace.AdamW) else opt.device_copy
    if not local and len(devices) == shard:
        what = ("without parity (pimhbm.adamw(group=0))" if isinstance(opt, inplace.AdamW)
                else "without the device copy (pimhbm.update.adamw(device_copy=False))")
        raise ValueError(f"{what} damaged chunks are repaired from another replica: that "
                         f"needs more devices than shard={shard} (a replica axis); got "
                         f"{len(devices)}")
    if multiprocess and transport is Transport.PEER:
        raise ValueError("replica_transport='peer' reads peer memory inside one process; "
                         "with several processes use 'ipc' or 'collective'")
    if not multiprocess and transport is Transport.IPC:
        raise ValueError("replica_transport='ipc' pulls from another process's GPU; within "
                         "one process use 'peer' or 'collective'")


# A re-executed step costs 1.5 steps at 8B-layer scale on the H200 (bench/checks_bench.py):
# every 200 steps that is 0.76 % of a step, within the 1 % the check may cost.
RECHECK_EVERY = 200
# A host snapshot costs ~27 ms at 8B-layer scale on the H200 (its copy outlasts the backward
# pass; bench/NOTES.md, run 138): every 250 steps that is ~0.13 % of a step.
SNAPSHOT_EVERY = 250



def _optimizer_learning_rate(opt) -> Callable[[int], float]:
    """The host's learning rate of a step when the user gives none: the optimizer's constant, or
    NaN where the optimizer evaluates a schedule on the device."""
    if callable(opt.learning_rate):
        return lambda step: float("nan")
    return lambda step: float(opt.learning_rate)

class Trainer(FaultHandling, RunLoop):
    """Protected training of ``loss_fn(params, batch) -> scalar`` (``loss_fn(params, batch,
    key)`` with ``rng``, a PRNG key: then each step and each device's slice of the batch gets
    its own key, the same again in a replay -- recovery/feed.py; with ``has_aux`` it returns
    ``(loss, aux)``, and each committed step's aux is in ``stats.aux``) with ``opt`` -- one copy of
    the state updated in place (pimhbm.adamw: parity for chunk repair unless
    ``group=0``), or two slots (pimhbm.update.adamw: a device copy unless ``device_copy=False``) --
    and, with
    ``shm_name``, host snapshots in POSIX shared memory that survive the process, every
    ``snapshot_every`` steps. The snapshot is the last resort (parity, replicas and the stash
    repair single chunks on the device), and with one copy the next update waits for its copy to
    the host wherever the copy outlasts the backward pass (~27 ms at Llama-3-8B-layer scale,
    where it takes ~111 ms: bench/NOTES.md, runs 82 and 138): so 250 by default, ~0.1 ms a step
    there, and a restore replays at most 250 steps.

    ``batch_fn(step)`` gives the batch of a step (1-based; any pytree of arrays whose first
    dimension splits over the devices), once a step:
    step 1's is asked for here (the shapes), and batches are logged (in the shared-memory region,
    else in this process's memory; ``log_ring`` steps, by default (snapshot_every + 8) x 2, or
    (in_flight + 8) x 2 without the region) so that replays, also after a crash, use exactly the
    same data without asking again. A loop the user owns: pass an example batch (its structure,
    shapes and dtypes are every batch's) in place of ``batch_fn``, then ``push(batch)`` each
    step's and ``flush()`` at the end -- the same engine, the steps still overlapped.
    ``inject_gradients``: compile the step with a hook that can write NaN/Inf into a gradient
    (fault campaigns); one tiny kernel per leaf per step.
    ``replica_transport``: how a chunk travels from a healthy replica (a Transport's value):
    "collective" (an XLA psum: any devices, any number of processes), "peer" (our kernel reads
    the source device's memory: the devices of one process) or "ipc" (another process's GPU
    over CUDA IPC).
    ``shard``: the size of the sharding axis (FSDP). The devices form a mesh ('dp', 'shard') of
    len(devices) / shard replicas; a parameter whose first dimension divides by ``shard`` is
    split along it (its master, moments, device copy and digest tables with it), the others
    are replicated. Digests, the update, scrubs and repairs work on each device's own shard; a
    chunk index is local to its device's shard.
    ``scrub_every``: a scrub between steps every this many steps (0: none; a suspect device is
    scrubbed at once either way). None: what the state needs -- none with one copy (each step
    verifies every chunk, and each committing update writes every parity row anew from its
    group), every 10 steps with two slots (the device copy is read by no step).
    ``telemetry``: "auto" watches the GPUs through NVML where it is there; a
    pimhbm.telemetry.Monitor of your own; None for none.
    A step skipped ``max_skips`` times in a row stops the run with PersistentFault.
    ``in_flight``: steps dispatched ahead of the one whose summary the host reads (more: the
    device waits less on a host that stalls; a fault halts, and replays, that many more).
    ``recheck_every``: every this many steps (0: never) the step's gradients are computed a
    second time, each device's slice on the next device, and compared bit for bit (sampled
    re-execution: finite wrong values no digest can see); a step whose gradients differ is
    undone and replayed, and a device whose gradients differ twice ends the run. It needs a
    repeatable step: by default every 200 steps where every step is (CPUs; GPUs with XLA's
    deterministic ops), else never (a step repeatable without the flag -- on pimhbm.attention
    and llama3's ordered embedding -- asks for it with recheck_every=200)."""

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], opt: AdamW, params: Any,
                 batch_fn: Callable[[int], dict[str, np.ndarray]], *,
                 learning_rate: Callable[[int], float] | None = None,
                 shm_name: str | None = None, snapshot_every: int = SNAPSHOT_EVERY, log_ring: int | None = None,
                 scrub_every: int | None = None, repair_capacity: int = 16,
                 fault_capacity: int = 64,
                 inject_gradients: bool = False, devices: Any = None, resume: bool = False,
                 telemetry: Any = "auto", replica_transport: str = "collective",
                 shard: int = 1, max_skips: int = 5, run_id: str | None = None,
                 recheck_every: int | None = None, in_flight: int = 2,
                 rng: jax.Array | None = None, has_aux: bool = False):
        ensure_registered()
        if not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight={in_flight!r}: at least one step must be in flight")
        self.in_flight = in_flight
        devices = list(devices) if devices is not None else jax.devices()
        replica_transport = _transport(replica_transport)
        _check_options(opt, replica_transport, devices, shard, max_skips, jax.process_count() > 1,
                       snapshots=shm_name is not None and bool(snapshot_every))
        self.opt, self.max_skips = opt, max_skips
        self.replica_transport = replica_transport
        self.placement = Placement(devices, shard)
        self.treedef = jax.tree.structure(params)
        sharded = [fsdp_spec(np.shape(p), shard) != jax.sharding.PartitionSpec()
                   for p in jax.tree.leaves(params)]
        self.layout = StateLayout.of(params, opt, sharded, shard)
        self.recheck_every = (recheck_every if recheck_every is not None else
                              RECHECK_EVERY if repeatable(devices) else 0)
        # An example batch instead of batch_fn: the batches come from push(), the user's loop.
        self.pushed, self._pending, self._loop = 0, {}, None
        self.pushing = pushing = not callable(batch_fn)
        if pushing and resume:
            raise ValueError("resume needs batch_fn: the steps past the batch log are asked for "
                             "by number")
        self.feed = BatchFeed(self._pushed_batch if pushing else batch_fn, rng, len(devices),
                              has_aux)
        sample = self.feed.flatten(batch_fn, 1) if pushing else self.feed(1)
        self.batch_keys, batch_specs, self._first_batch = sample_batch(sample, len(devices))
        kind = OneCopy if isinstance(opt, inplace.AdamW) else TwoSlots
        self.traced = kind(self.feed.loss(loss_fn), opt, self.treedef, self.layout, self.placement,
                           fault_capacity, inject_gradients,
                           inject_gradients and self.recheck_every > 0, replica_transport)
        self.device_copy = self.traced.device_copy
        self.scrub_every = (scrub_every if scrub_every is not None
                            else self.traced.default_scrub_every)
        given, params = params, self.placement.put_tree(params, self.traced.param_specs)
        self.learning_rate = learning_rate or _optimizer_learning_rate(opt)
        self.run_id = run_id
        # Steps of batches logged for replays: back to a host snapshot, or without one (a replay
        # then starts within the steps in flight) a few steps.
        depth = log_ring or ((snapshot_every if shm_name else in_flight) + 8) * 2
        self.backup = self._open_backup(shm_name, given, batch_specs, depth, resume)
        self.batches = BatchLog(self.backup, self.feed, self.batch_keys,
                                None if pushing else self._first_batch, depth)
        self._init = jax.jit(self.placement.manual(opt.init, (self.traced.param_specs,),
                                                   self.traced.state_specs().opt))
        sds = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        self.compiler = Compiler(self.traced, self._init, sds, batch_specs, repair_capacity,
                                 self.recheck_every > 0)
        self.programs = self.compiler.programs
        self.snapshots = SnapshotManager(self.backup, snapshot_every, self.compiler)
        self.transport = transport_for(replica_transport, self.programs, self.placement,
                                       self.layout, repair_capacity, self.traced,
                                       str(next(_TRAINERS)))
        local = (None if not self.traced.local_source else Action.REPAIRED_FROM_PARITY
                 if self.one_copy else Action.REPAIRED_FROM_DEVICE_COPY)
        self.repairer = Repairer(self.programs, self.placement, self.layout, self.transport,
                                 repair_capacity, self.device_copy, local)
        if isinstance(telemetry, str) and telemetry == "auto":
            telemetry = pimhbm.telemetry.Monitor()
        self.health = HealthWatch(telemetry, devices, self._failure)
        self.telemetry = self.health.monitor
        self.counter = CompileCounter()
        self.miscomputed: collections.Counter = collections.Counter()  # by device
        self.stats = RunStats(telemetry=self.health.status())
        self.state, self.next_step, self._scrub_due = None, 1, False
        if resume:
            self.resume()
        else:
            self.state = self.traced.fresh(self._init(params))

    def _open_backup(self, shm_name, params, batch_specs, ring, resume) -> HostBackup | None:
        if shm_name is None:
            return None
        # One region per process (each keeps the state of its own devices).
        region = (f"{shm_name}.p{jax.process_index()}" if self.placement.multiprocess
                  else shm_name)
        specs = snapshot_specs(params, self.layout)
        return HostBackup(region, specs, batch_specs, ring, create=not resume,
                          run=self._binding(params, specs))

    def _binding(self, params: Any, specs: list) -> bytes:
        return run_binding(params, self.opt, self.layout, specs, self._first_batch, self.run_id)

    # -- what the run is made of ---------------------------------------------------------------

    devices = property(lambda self: self.placement.devices)
    one_copy = property(lambda self: isinstance(self.traced, OneCopy),
                        doc="One copy of the state, updated in place (pimhbm.inplace).")
    local_source = property(lambda self: self.traced.local_source,
                            doc="Each device holds its own redundancy (device copy or parity).")
    mesh = property(lambda self: self.placement.mesh)
    shard = property(lambda self: self.layout.shard)
    multiprocess = property(lambda self: self.placement.multiprocess)
    paths = property(lambda self: list(self.layout.paths))
    names = property(lambda self: list(self.layout.names))
    sharded = property(lambda self: list(self.layout.sharded))
    sizes = property(lambda self: list(self.layout.sizes))
    nchunks = property(lambda self: self.layout.nchunks)
    compiles = property(lambda self: self.counter.count,
                        doc="Backend compilations while this trainer ran (after prewarm).")

    @property
    def snapshot_every(self) -> int:
        return self.snapshots.every

    @snapshot_every.setter
    def snapshot_every(self, every: int) -> None:
        _check_options(self.opt, self.replica_transport, self.placement.devices,
                       self.placement.shard, self.max_skips, jax.process_count() > 1,
                       snapshots=self.backup is not None and bool(every))
        self.snapshots.every = every

    @property
    def replica_timeout_s(self) -> float:
        return getattr(self.transport, "timeout_s", 30.0)

    # -- before and between runs -----------------------------------------------------------------

    def prewarm(self, cache_dir: str | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> dict[str, int]:
        """Compiles every program the run can need -- the step, the repairs, the scrub, the
        snapshots, fault injection -- from shapes alone (no device memory is touched), and
        starts counting compilations. ``cache_dir``: a persistent compilation cache, keyed by
        this library's version (a sub-folder per version). ``progress(done, total, what)`` is
        called after each program."""
        _, self.prewarm_seconds = prewarm(self.compiler, self.backup, cache_dir, progress)
        self.counter.count = 0
        return {"programs": len(self.programs), "seconds": round(self.prewarm_seconds, 2)}

    def restart(self, params: Any) -> None:
        """A new run from ``params`` with the same compiled programs (statistics, snapshots and
        the batch log start over)."""
        if jax.tree.structure(params) != self.treedef:
            raise ValueError("restart needs parameters of the same structure")
        if self.backup is not None:
            # The old run's copies and seal first: a seal after the rebind would seal the old
            # run's tensors under the new run's binding.
            self.snapshots.reset()
            self.backup.rebind(self._binding(params, self.backup.tensors))
        self.batches.reset()
        self.pushed, self._pending, self._loop = 0, {}, None
        params = self.placement.put_tree(params, self.traced.param_specs)
        self.state = self.traced.fresh(self._init(params))
        self.stats = RunStats(telemetry=self.health.status())
        self.next_step, self.counter.count = 1, 0

    def resume(self) -> int:
        """After a crash: the state from the newest host snapshot; the run goes on (and replays
        the logged batches) from the step after it. Returns that snapshot's step."""
        if self.backup is None:
            raise RuntimeError("resume needs the shared-memory backup (shm_name=)")
        self.state, step = self.snapshots.restore(self.treedef)
        self.next_step = step + 1
        return step

    def hlo_text(self) -> str:
        """The compiled step's HLO (both parities compile the same program shape)."""
        return self.programs.step[0].as_text()

    # -- the loop -----------------------------------------------------------------------------------

    def _launch(self, step: int, attempt: int, campaign: Any) -> InFlight:
        """Dispatches a step (and the scrub and snapshot due with it); fetches start at once."""
        self._scrub_due |= self.health.poll(step, self.stats)
        gf = campaign.before_step(self, step, attempt) if campaign else None
        loss, summary, recheck = self._guarded(step, lambda: self._dispatch(step, gf))
        scrub = None
        scheduled = bool(self.scrub_every and step % self.scrub_every == 0)
        if scheduled or self._scrub_due:
            if campaign and scheduled:
                campaign.before_scrub(self, step)
            self._scrub_due = False
            scrub = self.compiler.scheduled_scrub(slot_of(self.state.opt))(self.state)
            self.placement.settle(scrub)
            jax.tree.map(lambda x: x.copy_to_host_async(), scrub)
        if self.snapshots.should_save(step):
            self.snapshots.save_async(self.state, step)
        return InFlight(step, loss, summary, scrub, recheck)

    def _dispatch(self, step: int, grad_fault: GradientFault | None) -> tuple[Any, Any, Any]:
        """The step -- and, on a sampled step, its re-execution right behind it (before
        anything else reads the state: it may undo the step)."""
        p = self.placement
        batch = {k: p.put(a, p.by_device) for k, a in zip(self.batch_keys, self.batches.batch(step))}
        lr = p.put(np.float32(self.learning_rate(step)))
        gf = p.put(NO_GRADIENT_FAULT if grad_fault is None else grad_fault.encode())
        recheck = None
        key = slot_of(self.state.opt)
        if self.recheck_every and step % self.recheck_every == 0:
            program = self.programs.sampled[key]
            if self.traced.recheck_in_step:  # one copy: it ran before the update
                self.state, loss, summary, recheck = program(self.state, batch, lr, gf)
            else:
                self.state, loss, summary, digests = program(self.state, batch, lr, gf)
                p.settle(self.state, digests)
                self.state, recheck = self.programs.recheck[slot_of(self.state.opt)](
                    self.state, batch, summary.committed, digests)
        else:
            program = self.programs.step[key]
            self.state, loss, summary = program(self.state, batch, lr, gf)
        p.settle(self.state, summary)
        jax.tree.map(lambda x: x.copy_to_host_async(), (summary, loss, recheck))
        return loss, summary, recheck

    def _commit(self, done: InFlight, progress: Callable | None) -> None:
        self.stats.steps_committed += 1
        loss, aux = self.placement.fetch(done.loss)
        self.stats.losses[done.step] = float(loss)
        if aux is not None:
            self.stats.aux[done.step] = aux
        self.next_step = done.step + 1
        if done.scrub is not None:
            self._handle_scrub(done.step, self.placement.fetch(done.scrub))
        if progress:
            progress(done.step, self.stats)

    # -- device failures ------------------------------------------------------------------------

    def _failure(self, what: str, device: int | None = None) -> DeviceFailure:
        snap = self.snapshots.latest_step()
        how = ("restart the process and resume from the host snapshot of step "
               f"{snap} (Trainer(..., shm_name={self.backup.name!r}, resume=True))"
               if snap is not None else
               "there is no host snapshot to resume from (pass shm_name= to keep one)")
        return DeviceFailure(f"{what}. This process cannot use the device again: {how}.", device,
                             snap)

    def _guarded(self, step: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn``; a device error (a poisoned CUDA context after an uncorrectable ECC
        error, a lost GPU) becomes DeviceFailure with the way to resume, not a hang."""
        try:
            return fn()
        except jax.errors.JaxRuntimeError as err:
            raise self._failure(f"step {step}: device error: {err}") from err

    # -- fault injection into the live state (campaigns, tests) ---------------------------------

    def inject(self, path: str, tensor: str, fault: np.ndarray, *, into_copy: bool = False,
               device: int | None = None, rehash: bool = False) -> None:
        """Applies ``fault`` (pimhbm.faults.spec) in place to one tensor of the current slot (or
        of the device copy), on one device's copy or shard (``device``: its position in the
        mesh, row-major) or on every device's; offsets are within a device's shard.
        ``rehash``: the damaged copies' digests made anew too (a wrong computation; with
        replicas only)."""
        self.state = inject(self.state, self.compiler, path, tensor, fault, into_copy=into_copy,
                            device=device, rehash=rehash)

    def tensor_info(self) -> list[tuple[str, str, int, int]]:
        return self.layout.tensor_info()

    # -- results and the end ---------------------------------------------------------------------

    def current_state(self) -> dict[str, np.ndarray]:
        """The committed state as host arrays, by leaf and tensor (for comparisons)."""
        whole = np.asarray  # whole tensors (a sharded one assembled from its shards)
        if self.multiprocess:  # a collective: every process calls it
            from jax.experimental import multihost_utils
            whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return {f"{path}/{k}": whole(leaf[k][0])
                for path, leaf in zip(self.layout.paths, self.traced.tensors(self.state.opt))
                for k in self.layout.names}

    def close(self, unlink: bool = False) -> None:
        """Stops the telemetry watch, unmaps peers' memory (CUDA IPC), gives the shared-memory
        region up and, with ``unlink``, removes it."""
        self.health.close()
        if getattr(self.transport, "rounds", 0):
            pimhbm._core.ipc_close()  # the peers' memory this process mapped
        if self.backup is not None:
            self.snapshots.close()  # the copies and a seal in progress write the region
            self.backup.close()  # another process may resume from it now
            if unlink:
                HostBackup.unlink(self.backup.name)


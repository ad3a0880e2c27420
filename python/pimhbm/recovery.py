"""The recovery engine: train under protection, locate every fault, repair it in place, replay.

Each step runs one compiled program (per slot parity) that computes the gradients, updates the
state with :class:`pimhbm.AdamW` (digests checked and rewritten in the same pass, a device copy
kept current) and leaves a small fault summary on the device. The host fetches that summary
asynchronously and acts one step later, so the steady-state loop never waits for the device.

A step that saw damage commits nothing, and the *halt* flag it sets on the device makes every
step after it commit nothing too, so that nothing is applied out of order. When the host learns
of it, it

1. repairs the damaged chunks in place from the device copy (each source chunk checked against
   its digest first, each repaired chunk checked after) -- or, when the device copy is damaged
   too, restores the whole state from the newest host snapshot in shared memory;
2. clears the halt flag and replays the skipped steps from the batch log;
3. goes on, with the same compiled programs.

Host snapshots are taken every ``snapshot_every`` steps into POSIX shared memory (off the
critical path); a process killed mid-run resumes from there (:meth:`Trainer.resume`).
Every program the run can need is compiled ahead of time from shapes by :meth:`Trainer.prewarm`;
``Trainer.compiles`` counts backend compilations after that (there should be none).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pimhbm
from pimhbm import faults as faults_mod
from pimhbm import ipc, replica
from pimhbm._ffi import ensure_registered
from pimhbm.backup import HostBackup, TensorSpec, specs_of
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pimhbm.update import AdamW, AdamWState, Slot, slot_from_tensors, slot_tensors, tensor_dtype

TENSORS = ("p", "master", "mu", "nu")
TENSOR_BIT = {"p": 1, "master": 2, "mu": 4, "nu": 8}
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class TrainState(NamedTuple):
    opt: AdamWState
    halted: jax.Array  # int32: a step was skipped and not yet replayed; later steps skip too


def _after(x: jax.Array, previous: jax.Array | None) -> jax.Array:
    """``x``, available only once ``previous`` is: the peer ops of a program must run in the
    same order on every device (each meets its peers on the host), and XLA's CPU runtime may
    otherwise run independent ops in a different order on each device -- every device then
    waits at a different meeting until the timeout."""
    return x if previous is None else jax.lax.optimization_barrier((x, previous))[0]


def first_nonzero(flat: jax.Array, k: int) -> jax.Array:
    """int32[k]: the positions of the first k non-zero entries of ``flat`` in order, -1 past the
    last. As ``jnp.nonzero(flat, size=k, fill_value=-1)``, without its scatter: under XLA's
    deterministic ops a scatter becomes sorts of the whole array (~0.7 ms each for the ~10^5
    chunks of 2 Llama-3-8B layers, on every step). Entry j is where the running count of
    non-zeros first reaches j + 1: a cumulative sum and k x n comparisons, one fusion each."""
    if flat.shape[0] == 0:
        return jnp.full((k,), -1, jnp.int32)
    count = jnp.cumsum((flat != 0).astype(jnp.int32))
    idx = jnp.searchsorted(count, jnp.arange(1, k + 1, dtype=jnp.int32), side="left",
                           method="compare_all")
    return jnp.where(idx < flat.shape[0], idx, -1).astype(jnp.int32)


@dataclasses.dataclass
class Incident:
    """One fault the engine handled: where, what it did about it."""

    step: int
    kind: str  # "state" (digest mismatch), "gradient" (NaN/Inf), "device copy" (scrub)
    locations: list[tuple[int, str, str, int]]  # (device, leaf, tensor, chunk)
    action: str  # "repaired from the device copy", "restored from host snapshot @N", ...
    replayed: int = 0
    # gradient incidents: more chunks held NaN/Inf than the summary lists (typically a damaged
    # parameter upstream made the whole gradient non-finite); the list is then a prefix
    unlisted: bool = False


@dataclasses.dataclass
class RunStats:
    steps_committed: int = 0
    steps_skipped: int = 0
    steps_replayed: int = 0
    repairs: int = 0
    host_restores: int = 0
    replica_repairs: int = 0  # chunks pulled from another device's copy of the state
    ipc_pulls: int = 0  # chunks pulled from another process's GPU over CUDA IPC (repairs, rebuilds)
    replica_rebuilds: int = 0  # devices whose whole state was rebuilt from another's
    snapshots: int = 0
    scrubs: int = 0
    compiles_after_prewarm: int = 0
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    incidents: list[Incident] = dataclasses.field(default_factory=list)
    telemetry: str = "off"  # what the hardware telemetry watches, or why it does not
    telemetry_events: list[Any] = dataclasses.field(default_factory=list)  # TelemetryEvent
    suspect_devices: set[int] = dataclasses.field(default_factory=set)  # positions in devices


class DeviceFailure(RuntimeError):
    """A device failed in a way this process cannot go on from (a poisoned CUDA context, a GPU
    lost): restart the process and resume from the host snapshot in shared memory
    (``Trainer(..., shm_name=<same>, resume=True)``, or ``pimhbm recover --resume``)."""

    def __init__(self, message: str, device: int | None, snapshot_step: int | None):
        super().__init__(message)
        self.device = device
        self.snapshot_step = snapshot_step


_TRAINERS = itertools.count()  # numbers each Trainer of a process (its IPC keys)


class PersistentFault(RuntimeError):
    """The same step was skipped on every replay: the damage comes back each time, so it is not
    a transient fault the engine can repair (a gradient that is non-finite on its own -- the
    loss diverged, bad data -- or a device that computes wrongly). ``step``, ``skips``, and the
    last skip's ``incidents``."""

    def __init__(self, message: str, step: int, skips: int, incidents: list[Incident]):
        super().__init__(message)
        self.step = step
        self.skips = skips
        self.incidents = incidents


def fsdp_spec(shape: tuple[int, ...], shard: int) -> P:
    """How the engine places a parameter of ``shape`` over a 'shard' axis of ``shard`` devices:
    split along its first dimension when that divides evenly, else replicated."""
    return P("shard") if shard > 1 and len(shape) > 0 and shape[0] % shard == 0 else P()


def _keystr(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


class Trainer:
    """Protected training of ``loss_fn(params, batch) -> scalar`` with a device copy and
    (optionally) host snapshots in shared memory ``shm_name``.

    ``batch_fn(step) -> dict of numpy arrays`` gives the batch of a step (1-based); batches are
    logged so that replays (also after a crash) use exactly the same data.
    ``inject_gradients``: compile the step with a hook that can write NaN/Inf into a gradient
    (for fault campaigns); costs one tiny kernel per leaf per step.
    ``replica_transport``: how a chunk travels from a healthy replica -- "collective" (an XLA
    psum inside a pre-compiled program: any devices, any number of processes) or "peer" (our
    kernel reads the source device's memory directly: the devices of this process).
    ``shard``: the size of the sharding axis (FSDP). The devices form a mesh ('dp', 'shard') of
    len(devices) / shard replicas; a parameter whose first dimension divides by ``shard`` is
    split along it over 'shard' (its master, moments, device copy and digest tables with it),
    the others are replicated. Digests, the guarded update, scrubs and repairs work on each
    device's own shard; a chunk index is local to its device's shard; replica repairs pull
    from the device with the same shard in another replica."""

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], opt: AdamW, params: Any,
                 batch_fn: Callable[[int], dict[str, np.ndarray]], *,
                 learning_rate: Callable[[int], float] | None = None,
                 shm_name: str | None = None, snapshot_every: int = 25, log_ring: int | None = None,
                 scrub_every: int = 10, repair_capacity: int = 16, fault_capacity: int = 64,
                 inject_gradients: bool = False, devices: Any = None, resume: bool = False,
                 telemetry: Any = "auto", replica_transport: str = "collective",
                 shard: int = 1, max_skips: int = 5):
        ensure_registered()
        if max_skips < 2:
            raise ValueError(f"max_skips={max_skips}: a step must be allowed at least one replay")
        # A step skipped this many times in a row (no commit between) stops the run with
        # PersistentFault: repaired damage that comes back on every replay is not transient.
        self.max_skips = max_skips
        if replica_transport not in ("collective", "peer", "ipc"):
            raise ValueError(f"replica_transport must be 'collective', 'peer' or 'ipc', got "
                             f"{replica_transport!r}")
        self.replica_transport = replica_transport
        # Without the device copy (pimhbm.adamw(device_copy=False)) every damaged chunk is
        # pulled from another replica, current to the same committed step: the update writes
        # 12 bytes a parameter less (bf16 p, the master's remainder, mu, nu) where replicas hold
        # the state.
        self.device_copy = opt.device_copy
        self.loss_fn, self.opt, self.batch_fn = loss_fn, opt, batch_fn
        # The learning rate of a step: a host function of the step, or the optimizer's own
        # (a constant, or a schedule it evaluates on the device).
        self.learning_rate = learning_rate or (
            (lambda step: float("nan")) if callable(opt.learning_rate)
            else (lambda step: float(opt.learning_rate)))
        # Data parallel over `devices` (default: every device of the default backend; one is
        # fine) and, with shard > 1, parameters split over the 'shard' axis: each device holds
        # its shard of the protected state and a slice of every batch.
        devices = list(devices) if devices is not None else jax.devices()
        if shard < 1 or len(devices) % shard:
            raise ValueError(f"shard={shard} must divide the {len(devices)} devices")
        self.shard = shard
        if not opt.device_copy and len(devices) == shard:
            raise ValueError("without the device copy (pimhbm.adamw(device_copy=False)) damaged "
                             "chunks are repaired from another replica: that needs more devices "
                             f"than shard={shard} (a replica axis); got {len(devices)}")
        # One process per GPU (jax.distributed): each process feeds and reads its own devices;
        # what the host decides on (fault summaries, statuses) is gathered inside the programs
        # so that every process sees every device's rows and decides alike.
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess and replica_transport == "peer":
            raise ValueError("replica_transport='peer' reads peer memory inside one process; "
                             "with several processes use 'ipc' or 'collective'")
        if not self.multiprocess and replica_transport == "ipc":
            raise ValueError("replica_transport='ipc' pulls from another process's GPU; within "
                             "one process use 'peer' or 'collective'")
        # IPC pulls: rounds numbered alike in every process; the reason IPC was given up (the
        # collective transport is used from then on); the bound on every wait of a round.
        self._ipc_round, self._ipc_off, self.replica_timeout_s = 0, None, 30.0
        self._ipc_run = str(next(_TRAINERS))  # keys of this trainer's rounds (same everywhere)
        self.mesh = Mesh(np.array(devices).reshape(len(devices) // shard, shard), ("dp", "shard"))
        self.devices = devices
        # Who writes this process's host snapshot: per shard column, its first device here.
        me = jax.process_index()
        self._writers = {}
        for col in range(shard):
            local = [d for d in self.mesh.devices[:, col] if d.process_index == me]
            if local:
                self._writers[col] = local[0]
        self.replicated = NamedSharding(self.mesh, P())
        self.by_device = NamedSharding(self.mesh, P(("dp", "shard")))  # a row per device
        self.by_column = NamedSharding(self.mesh, P("shard"))  # a row per shard column
        self.grid = NamedSharding(self.mesh, P("dp", "shard"))  # (replica, column)
        # Per-device reports, stacked in mesh order (with several processes: gathered).
        self.report_spec = P() if self.multiprocess else P(("dp", "shard"))
        self.snapshot_every, self.scrub_every = snapshot_every, scrub_every
        self.repair_capacity, self.fault_capacity = repair_capacity, fault_capacity
        self.inject_gradients = inject_gradients
        # Hardware telemetry (NVML): "auto" watches when NVML is there; a Monitor of your own
        # (another library path, another poll interval); None for none.
        if isinstance(telemetry, str) and telemetry == "auto":
            telemetry = pimhbm.telemetry.Monitor()
        self.telemetry = telemetry
        self._nvml_position = self._map_nvml_devices(devices)
        self._scrub_due = False
        self._state_lost = False
        self.stats = RunStats()
        self.stats.telemetry = self._telemetry_status()
        self._compile_count = 0
        self._counting = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

        self.treedef = jax.tree.structure(params)
        self.paths = [_keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        self.names = list(TENSORS) if opt.master_weights else ["p", "mu", "nu"]
        leaves = jax.tree.leaves(params)
        # FSDP: a leaf is split along its first dimension when that divides by `shard`.
        self._leaf_specs = [fsdp_spec(np.shape(p), shard) for p in leaves]
        self.sharded = [spec == P("shard") for spec in self._leaf_specs]
        self.param_specs = jax.tree.unflatten(self.treedef, self._leaf_specs)
        params = self._put_params(params)
        # Elements of each leaf on one device (its shard).
        self.sizes = [int(np.prod(np.shape(p))) // (shard if sh else 1)
                      for p, sh in zip(leaves, self.sharded)]
        self.nchunks = [-(-n // opt.chunk_elems) for n in self.sizes]
        self.chunk_base = np.concatenate([[0], np.cumsum(self.nchunks)]).astype(np.int64)

        sample = {k: np.asarray(v) for k, v in batch_fn(1).items()}
        for k, v in sample.items():
            if v.ndim == 0 or v.shape[0] % len(devices):
                raise ValueError(f"batch array {k!r} of shape {v.shape}: its first dimension must "
                                 f"split evenly over {len(devices)} devices")
        self.batch_keys = sorted(sample)
        self.batch_specs = specs_of((k, sample[k]) for k in self.batch_keys)

        self.backup = None
        if shm_name is not None:
            ring = log_ring or (snapshot_every + 8) * 2
            tensors = self._snapshot_specs(params)
            # One region per process (each keeps the state of its own devices).
            region = f"{shm_name}.p{jax.process_index()}" if self.multiprocess else shm_name
            self.backup = HostBackup(region, tensors, self.batch_specs, ring, create=not resume)

        self._programs: dict[Any, Any] = {}
        self.state = None
        self.next_step = 1
        self._params_sds = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        self._init = jax.jit(self._manual(self.opt.init, (self.param_specs,), self._opt_specs()))
        if resume:
            self.resume()
        else:
            self.state = TrainState(self._init(params), self._put(np.int32(0)))

    def restart(self, params: Any) -> None:
        """A new run from ``params`` with the same compiled programs (statistics, snapshots and
        the batch log start over)."""
        if jax.tree.structure(params) != self.treedef:
            raise ValueError("restart needs parameters of the same structure")
        self.state = TrainState(self._init(self._put_params(params)), self._put(np.int32(0)))
        self.stats = RunStats()
        self.stats.telemetry = self._telemetry_status()
        self.next_step = 1
        self._compile_count = 0
        if self.backup is not None:
            for slot in (0, 1):
                self.backup._slot_header(slot)[:] = 0
            for r in range(self.backup.ring):
                self.backup._record_header(r)[:] = 0

    def _put_params(self, params: Any) -> Any:
        return jax.tree.map(lambda p, spec: self._put(p, NamedSharding(self.mesh, spec)),
                            params, self.param_specs, is_leaf=lambda x: isinstance(x, P))

    def _slot_specs(self) -> Any:
        """The PartitionSpecs of a Slot: each tensor and digest table as its parameter."""
        ps = self.param_specs
        tables = jax.tree.map(lambda spec: {k: spec for k in self.names}, ps,
                              is_leaf=lambda x: isinstance(x, P))
        return Slot(ps, ps if self.opt.master_weights else None, ps, ps, tables)

    def _opt_specs(self, current: int = 0) -> AdamWState:
        slot = self._slot_specs()
        return AdamWState((slot, slot), current, P(), slot if self.device_copy else None)

    def _state_specs(self, current: int = 0) -> TrainState:
        return TrainState(self._opt_specs(current), P())

    def _manual(self, fn, in_specs, out_specs):
        """``fn`` per device over the mesh. check_vma=False: the copies of the state are equal
        on every replica by construction (the verdict is global), which the checker cannot see
        through the custom calls."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _put(self, x: Any, sharding: Any = None, copy: bool = False) -> jax.Array:
        # From the host, each process filling only its own devices' parts. copy: through a
        # fresh host copy per part on the CPU, where a put may share the source's buffer (a
        # region view), and every copy of the state must own its buffers (they are donated);
        # a GPU put makes device buffers anyway.
        x = np.asarray(x)
        copy = copy and self.devices[0].platform == "cpu"
        part = (lambda idx: np.array(x[idx])) if copy else (lambda idx: x[idx])
        return jax.make_array_from_callback(x.shape, sharding or self.replicated, part)

    def _per_device(self, x: jax.Array) -> jax.Array:
        """A per-device report row: stacked over devices (each process its own rows) or, with
        several processes, gathered to every device so that every process reads all rows."""
        return jax.lax.all_gather(x, ("dp", "shard"), tiled=True) if self.multiprocess else x

    def _fetch(self, x: jax.Array) -> np.ndarray:
        """A report on the host (with several processes: the local copy of the gathered one)."""
        return np.asarray(x.addressable_shards[0].data) if self.multiprocess else np.asarray(x)

    # -- compile counting ----------------------------------------------------------------------

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT and self._counting:
            self._compile_count += 1

    @property
    def compiles(self) -> int:
        """Backend compilations while this trainer ran (after :meth:`prewarm`)."""
        return self._compile_count

    # -- the programs --------------------------------------------------------------------------

    def _step_fn(self, state: TrainState, batch: dict, lr: jax.Array, grad_fault: jax.Array):
        """One device's part of a step (inside shard_map over the mesh): gradients of its slice
        of the batch, their mean over devices, the guarded update with a global verdict. With a
        sharding axis (FSDP) the sharded parameters are gathered for the forward pass and their
        gradients reduce-scattered back to the shards."""
        # The mean over devices is taken on the loss, before differentiation: its 1/n then
        # scales the backward pass's seed, and the summed gradients need no pass of their own
        # (a division after the psum is an elementwise pass over every gradient that XLA cannot
        # fuse into the update's custom call: 0.7 ms a step for 0.5 B bf16 gradients).
        n = len(self.devices)
        scaled = lambda params: self.loss_fn(params, batch) / n
        if self.shard == 1:
            loss, grads = jax.value_and_grad(scaled)(state.opt.params)
            loss = jax.lax.psum(loss, "dp")
            grads = jax.lax.psum(grads, "dp")
        else:
            local = self.treedef.flatten_up_to(state.opt.params)
            full = [jax.lax.all_gather(p, "shard", axis=0, tiled=True) if sh else p
                    for p, sh in zip(local, self.sharded)]
            loss, grads = jax.value_and_grad(scaled)(jax.tree.unflatten(self.treedef, full))
            loss = jax.lax.psum(loss, ("dp", "shard"))
            grads = [jax.lax.psum(jax.lax.psum_scatter(g, "shard", scatter_dimension=0, tiled=True)
                                  if sh else jax.lax.psum(g, "shard"), "dp")
                     for g, sh in zip(self.treedef.flatten_up_to(grads), self.sharded)]
            grads = jax.tree.unflatten(self.treedef, grads)
        if self.inject_gradients:
            leaves = self.treedef.flatten_up_to(grads)
            spec = jnp.where(jnp.arange(len(leaves))[:, None] == grad_fault[0], grad_fault[1:],
                             jnp.zeros((8,), jnp.int32))
            grads = jax.tree.unflatten(self.treedef, [
                faults_mod.inject_in_graph(g, spec[i]) for i, g in enumerate(leaves)])
        lr = None if callable(self.opt.learning_rate) else lr
        opt, report = self.opt.update(grads, state.opt, lr, gate=state.halted == 0,
                                      axis_name=("dp", "shard"))
        halted = state.halted | (~report.committed).astype(jnp.int32)
        return TrainState(opt, halted), loss, self._per_device(self._summary(report)[None])

    def _fault_list(self, maps: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(global chunk index, value) of the first fault_capacity non-zero map entries."""
        flat = jnp.concatenate([m.reshape(-1) for m in maps]) if maps else jnp.zeros((0,), jnp.int32)
        idx = first_nonzero(flat, self.fault_capacity)
        return idx, jnp.where(idx >= 0, flat[jnp.maximum(idx, 0)], 0)

    def _summary(self, report) -> jax.Array:
        """This device's int32 summary: committed (global), NaN/Inf gradients and faulty chunks
        (both of this device), then the fault list (index, bits) and the NaN/Inf gradient list
        (index, count)."""
        fault_maps = self.treedef.flatten_up_to(report.fault_maps)
        grad_maps = self.treedef.flatten_up_to(report.grad_nonfinite_maps)
        f_idx, f_bits = self._fault_list(fault_maps)
        g_idx, g_cnt = self._fault_list(grad_maps)
        local_faults, local_bad = report.local_counts[0], report.local_counts[1]
        head = jnp.stack([report.committed.astype(jnp.int32), local_bad, local_faults])
        return jnp.concatenate([head, f_idx, f_bits, g_idx, g_cnt])

    def _repair_fn(self, state: TrainState, lists: jax.Array, *, into_copy: bool):
        """Repairs listed chunks of the current slot from the device copy (or, into_copy, the
        device copy from the current slot). lists: int32 (leaves, tensors, capacity)."""
        opt = state.opt
        cur = slot_tensors(opt.slots[opt.current], self.treedef)
        copy = slot_tensors(opt.device_copy, self.treedef)
        src, dst = (cur, copy) if into_copy else (copy, cur)
        statuses, new = [], []
        for i, (s_leaf, d_leaf) in enumerate(zip(src, dst)):
            leaf = {}
            for j, k in enumerate(self.names):
                (t, tt), status = pimhbm.repair(lists[i, j], s_leaf[k], d_leaf[k],
                                                self.opt.chunk_bytes(s_leaf[k][0].dtype))
                leaf[k] = (t, tt)
                statuses.append(status)
            new.append(leaf)
        slot = slot_from_tensors(new, self.treedef)
        if into_copy:
            opt = AdamWState(opt.slots, opt.current, opt.step, slot)
        else:
            opt = opt.replace_current(slot)
        return TrainState(opt, state.halted), self._per_device(
            jnp.stack(statuses).reshape(lists.shape)[None])

    def _replica_fn(self, state: TrainState, lists: jax.Array, src: jax.Array):
        lists, src = lists[0], src[0]  # this device's shard column
        """Repairs listed chunks of the current slot from another device's copy of the state
        (inside shard_map; every copy is current to the last committed step). lists, src: int32
        (shard, leaves, tensors, capacity), a row per shard column: the chunk, and the replica
        (index along 'dp') whose copy of it is healthy. Transport "collective": one psum of the chunks' raw bits and digest
        rows (pimhbm.replica); "peer": each device reads the chunk from the source's memory
        (pimhbm.peer.pull). Either way the received chunk is checked against the source's
        digest before it is written and the target after. Returns the new state and statuses
        [1, leaves, tensors, capacity] (the source device's own entries are NOT_LISTED)."""
        opt = state.opt
        cur = slot_tensors(opt.slots[opt.current], self.treedef)
        statuses, new = [], []
        for i, leaf in enumerate(cur):
            out = {}
            for j, k in enumerate(self.names):
                t, table = leaf[k]
                cb = self.opt.chunk_bytes(t.dtype)
                if self.replica_transport == "peer":
                    out[k], status = pimhbm.peer.pull(
                        _after(lists[i, j], statuses[-1] if statuses else None), src[i, j],
                        (t, table), cb, "dp", self.mesh)
                else:
                    out[k], status = replica.pull_collective(lists[i, j], src[i, j], (t, table),
                                                             cb, "dp")
                statuses.append(status)
            new.append(out)
        opt = opt.replace_current(slot_from_tensors(new, self.treedef))
        return TrainState(opt, state.halted), self._per_device(
            jnp.stack(statuses).reshape(lists.shape)[None])

    def _rebuild_fn(self, state: TrainState, source: jax.Array, targets: jax.Array):
        """A whole state (current slot and device copy) rebuilt on the ``targets`` devices
        (int32 (dp, shard), 1 = rebuild) from replica ``source`` (int32 per shard column: an
        index along 'dp'). Transport "peer": every chunk of every tensor pulled from the
        source's memory (pimhbm.peer.pull: each checked against the source's digest and its
        own after the copy); otherwise ("collective"; "ipc" when IPC is unavailable) one psum
        of the raw bits of every tensor and digest table, checked after. Returns the state
        and, per device, the number of chunks of its current slot that are not good
        afterwards [1]."""
        opt = state.opt
        source = source[0]
        take = targets[0, 0] != 0
        cur = slot_tensors(opt.slots[opt.current], self.treedef)
        new, bad, after = [], jnp.int32(0), None
        for leaf in cur:
            out = {}
            for k in self.names:
                t, table = leaf[k]
                cb = self.opt.chunk_bytes(t.dtype)
                if self.replica_transport == "peer":
                    n = table.shape[0]
                    chunks = _after(jnp.where(take, jnp.arange(n, dtype=jnp.int32), -1), after)
                    (t, table), after = pimhbm.peer.pull(
                        chunks, jnp.full((n,), source, jnp.int32), (t, table), cb, "dp", self.mesh)
                    bad += jnp.sum(take & (after != pimhbm.REPAIRED), dtype=jnp.int32)
                else:
                    t, table = (replica.copy_whole(x, source, take, "dp") for x in (t, table))
                    bad += jnp.sum(pimhbm.verify(t, table, cb), dtype=jnp.int32)
                out[k] = (t, table)
            new.append(out)
        slot = slot_from_tensors(new, self.treedef)
        opt = AdamWState(opt.slots, opt.current, opt.step,
                         self._copy_of_rebuilt(slot, opt.device_copy, take)).replace_current(slot)
        return TrainState(opt, state.halted), self._per_device(bad[None])

    @staticmethod
    def _copy_of_rebuilt(slot: Slot, mirror: Slot | None, take: jax.Array) -> Slot | None:
        """The device copy of a rebuilt device: the same as its new current slot (after a
        commit the copy equals the state; nothing committed since); elsewhere unchanged."""
        if mirror is None:
            return None
        return jax.tree.map(lambda n, m: jnp.where(take, n, m), slot, mirror)

    def _recopy_fn(self, state: TrainState, targets: jax.Array):
        """The device copy of the ``targets`` devices (int32 (dp, shard), 1 = yes) made anew
        from their current slot (after a whole state was pulled into it over CUDA IPC)."""
        opt = state.opt
        take = targets[0, 0] != 0
        mirror = self._copy_of_rebuilt(opt.slots[opt.current], opt.device_copy, take)
        return TrainState(AdamWState(opt.slots, opt.current, opt.step, mirror), state.halted)

    def _scrub_fn(self, state: TrainState) -> jax.Array:
        """A full digest sweep of the current slot and the device copy: per chunk, the bits of
        the current slot's damaged tensors, and those of the copy shifted by 4."""
        opt = state.opt
        maps = []
        cur_leaves = slot_tensors(opt.slots[opt.current], self.treedef)
        copies = ([None] * len(cur_leaves) if opt.device_copy is None
                  else slot_tensors(opt.device_copy, self.treedef))
        for cur, copy in zip(cur_leaves, copies):
            acc = jnp.zeros((cur["p"][1].shape[0],), jnp.int32)
            for k in self.names:
                cb = self.opt.chunk_bytes(cur[k][0].dtype)
                acc |= pimhbm.verify(cur[k][0], cur[k][1], cb).astype(jnp.int32) * TENSOR_BIT[k]
                if copy is not None:
                    acc |= pimhbm.verify(copy[k][0], copy[k][1],
                                         cb).astype(jnp.int32) * (TENSOR_BIT[k] << 4)
            maps.append(acc)
        idx, bits = self._fault_list(maps)
        return self._per_device(jnp.concatenate([idx, bits])[None])

    def _snapshot_fn(self, state: TrainState, *, slot: int, part: int = 0) -> jax.Array:
        """Runs on this process's writer of shard column ``part``: it writes its shard of every
        sharded tensor (and, the first writer only, the replicated ones) to its place in the
        region (one writer per byte)."""
        opt = state.opt
        offsets = iter(self.backup.offsets(slot))
        tensors, where = [], []
        for leaf, sharded in zip(slot_tensors(opt.slots[opt.current], self.treedef), self.sharded):
            for k in self.names:
                for x in leaf[k]:
                    offset = next(offsets)
                    if sharded or part == min(self._writers):
                        tensors.append(x)
                        where.append(offset + (part * x.size * x.dtype.itemsize if sharded else 0))
        return pimhbm.backup_snapshot(tensors, self.backup.region, where)

    def _snapshot_specs(self, params) -> list[TensorSpec]:
        """Whole tensors; a sharded tensor's digest table holds its shards' tables in order."""
        named = []
        for path, p, n, sharded in zip(self.paths, jax.tree.leaves(params), self.sizes, self.sharded):
            chunks = -(-n // self.opt.chunk_elems) * (self.shard if sharded else 1)
            for k in self.names:
                dtype = tensor_dtype(k, p.dtype)
                named.append((f"{path}/{k}", jax.ShapeDtypeStruct(p.shape, dtype)))
                named.append((f"{path}/{k}#digests", jax.ShapeDtypeStruct((chunks, 2), jnp.uint32)))
        return specs_of(named)

    def _abstract_state(self, current: int) -> TrainState:
        """The state's global shapes with their shardings."""
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype),
                              self.state.opt.params if self.state is not None else self._params_sds)
        shapes = jax.eval_shape(self._init, params)
        opt = AdamWState(shapes.slots, current, shapes.step, shapes.device_copy)
        put = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                   sharding=NamedSharding(self.mesh, spec))
        state = TrainState(opt, jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(put, state, self._state_specs(current))

    def _local_state(self, current: int, device: Any) -> TrainState:
        """One device's part of the state (its shards), placed on ``device``."""
        where = jax.sharding.SingleDeviceSharding(device)
        put = lambda x, spec: jax.ShapeDtypeStruct(
            (x.shape[0] // self.shard, *x.shape[1:]) if "shard" in tuple(spec) else x.shape,
            x.dtype, sharding=where)
        return jax.tree.map(put, self._abstract_state(current), self._state_specs(current))

    def prewarm(self, cache_dir: str | None = None) -> dict[str, int]:
        """Compiles every program the run can need -- the step, the repairs, the scrub, the
        snapshots, fault injection -- from shapes alone (no device memory is touched), and
        starts counting compilations. ``cache_dir``: a persistent compilation cache, keyed by
        this library's version (a sub-folder per version)."""
        if cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir",
                              os.path.join(cache_dir, f"pimhbm-{pimhbm.__version__}"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.perf_counter()
        rep, dev = self.replicated, self.by_device
        sds = lambda shape, dtype, sh=rep: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
        batch = {s.name: sds(s.shape, s.dtype, dev) for s in self.batch_specs}
        lists = sds((len(self.paths), len(self.names), self.repair_capacity), jnp.int32)
        column_lists = sds((self.shard, *lists.shape), jnp.int32, self.by_column)
        each = self.report_spec
        for current in (0, 1):
            st = self._abstract_state(current)
            ss = self._state_specs(current)
            # The step hands over to the other slot: its output is the other parity's state.
            # The batch is split over every device (each computes its own part), in every
            # process layout; only the reports are gathered whole where processes must all read
            # them (report_spec).
            step = self._manual(self._step_fn, (ss, dev.spec, P(), P()),
                                (self._state_specs(1 - current), P(), each))
            self._programs["step", current] = jax.jit(step, donate_argnums=0).lower(
                st, batch, sds((), jnp.float32), sds((9,), jnp.int32)).compile()
            for into_copy in ((False, True) if self.device_copy else ()):
                fn = self._manual(lambda s, l, c=into_copy: self._repair_fn(s, l, into_copy=c),
                                  (ss, P()), (ss, each))
                self._programs["repair", current, into_copy] = jax.jit(
                    fn, donate_argnums=0).lower(st, lists).compile()
            if len(self.devices) > self.shard:  # a replica axis: repairs from another replica
                fn = self._manual(self._replica_fn, (ss, P("shard"), P("shard")), (ss, each))
                self._programs["replica", current] = jax.jit(fn, donate_argnums=0).lower(
                    st, column_lists, column_lists).compile()
                fn = self._manual(self._rebuild_fn, (ss, P("shard"), P("dp", "shard")), (ss, each))
                self._programs["rebuild", current] = jax.jit(fn, donate_argnums=0).lower(
                    st, sds((self.shard,), jnp.int32, self.by_column),
                    sds(self.mesh.devices.shape, jnp.int32, self.grid)).compile()
                if self.replica_transport == "ipc" and self.device_copy:
                    fn = self._manual(self._recopy_fn, (ss, P("dp", "shard")), ss)
                    self._programs["recopy", current] = jax.jit(fn, donate_argnums=0).lower(
                        st, sds(self.mesh.devices.shape, jnp.int32, self.grid)).compile()
            self._scrub_program(current)
            if self.backup is not None:
                for part, device in self._writers.items():
                    one = self._local_state(current, device)
                    for slot in (0, 1):
                        fn = lambda s, slot=slot, part=part: self._snapshot_fn(s, slot=slot, part=part)
                        self._programs["snapshot", current, slot, part] = jax.jit(fn).lower(
                            one).compile()
        # Fault injection on every state tensor shape (campaigns), and the host-side checks of
        # snapshots (verify on the CPU).
        slot_specs = self._slot_specs()
        for leaf, spec in zip(jax.tree.leaves(self._abstract_state(0).opt.slots[0]),
                              jax.tree.leaves(slot_specs, is_leaf=lambda x: isinstance(x, P))):
            self._inject_program(leaf.shape, leaf.dtype, spec)
        if self.backup is not None:
            self._clone_program()
        self.prewarm_seconds = time.perf_counter() - t0
        self._compile_count = 0
        return {"programs": len(self._programs), "seconds": round(self.prewarm_seconds, 2)}

    def _scrub_program(self, current: int):
        key = ("scrub", current)
        if key not in self._programs:
            scrub = self._manual(self._scrub_fn, (self._state_specs(current),), self.report_spec)
            self._programs[key] = jax.jit(scrub).lower(self._abstract_state(current)).compile()
        return self._programs[key]

    def _clone_program(self):
        """Two more copies of a slot, on the devices (a restore puts the snapshot on the
        devices once and makes the other slot and the device copy from it there)."""
        if "clone" not in self._programs:
            slot = self._abstract_state(0).opt.slots[0]
            fn = lambda x: (jax.tree.map(jnp.copy, x),
                            jax.tree.map(jnp.copy, x) if self.device_copy else None)
            self._programs["clone"] = jax.jit(fn).lower(slot).compile()
        return self._programs["clone"]

    def hlo_text(self) -> str:
        """The compiled step's HLO (both parities compile the same program shape)."""
        return self._programs["step", 0].as_text()

    def _on_device(self, state: TrainState, device: Any) -> TrainState:
        """``device``'s part of the state, as single-device arrays (no copy)."""
        return jax.tree.map(lambda a: next(s.data for s in a.addressable_shards
                                           if s.device == device), state)

    @property
    def _serialize(self) -> bool:
        # The host platform's virtual devices share one thread pool: programs with collectives
        # queued back to back can each hold threads the other's rendezvous waits for, and hang
        # (seen with 4 virtual devices on 2 cores). There each program is waited for before
        # the next is queued. GPUs run each device's programs on their own streams: no wait.
        return self.devices[0].platform == "cpu" and len(self.devices) > 1

    def _settle(self, *values: Any) -> None:
        if self._serialize:
            jax.block_until_ready(values)

    def _run_snapshot(self, slot: int) -> list[jax.Array]:
        """This process's writers write their shards (one program each)."""
        self.backup.wait_pinned()  # a reopened region is pinned in the background
        tickets = []
        for part, device in self._writers.items():
            program = self._programs["snapshot", self.state.opt.current, slot, part]
            tickets.append(program(self._on_device(self.state, device)))
            self._settle(tickets[-1])
        return tickets

    def _inject_program(self, shape, dtype, spec=P()):
        """Fault injection into some devices' copies (or shards) of a tensor, in place: one
        program for all devices, a spec row per device (kind 0: leave this copy alone)."""
        key = ("inject", tuple(shape), jnp.dtype(dtype), tuple(spec))
        if key not in self._programs:
            fn = self._manual(lambda x, f: faults_mod.inject_in_graph(x, f[0]),
                              (spec, P(("dp", "shard"))), spec)
            self._programs[key] = jax.jit(fn, donate_argnums=0).lower(
                jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec)),
                jax.ShapeDtypeStruct((len(self.devices), 8), jnp.int32,
                                     sharding=self.by_device)).compile()
        return self._programs[key]

    # -- the loop ------------------------------------------------------------------------------

    def _batch(self, step: int) -> dict[str, jax.Array]:
        logged = self.backup.logged_batch(step) if self.backup is not None else None
        if logged is None:
            arrays = self.batch_fn(step)
            logged = [np.asarray(arrays[k]) for k in self.batch_keys]
            if self.backup is not None:
                self.backup.log_batch(step, logged)
        return {k: self._put(a, self.by_device) for k, a in zip(self.batch_keys, logged)}

    def _dispatch(self, step: int, grad_fault: np.ndarray | None) -> jax.Array:
        batch = self._batch(step)
        lr = self._put(np.float32(self.learning_rate(step)))
        gf = np.zeros(9, np.int32) if grad_fault is None else grad_fault
        program = self._programs["step", self.state.opt.current]
        self.state, loss, summary = program(self.state, batch, lr, self._put(gf))
        self._settle(self.state, summary)
        summary.copy_to_host_async()
        loss.copy_to_host_async()
        return loss, summary

    def run(self, until: int, campaign: Any = None, progress: Callable[[int, RunStats], None] | None = None) -> RunStats:
        """Trains up to step ``until`` (inclusive). ``campaign``: an object with
        ``before_step(trainer, step, attempt) -> grad fault spec or None`` and
        ``before_scrub(trainer, step)`` that injects faults (see pimhbm.campaign)."""
        if not self._programs:
            raise RuntimeError("call prewarm() first: every program is compiled ahead of time")
        self._counting = True  # compilations are counted while the run goes on
        try:
            return self._run(until, campaign, progress)
        finally:
            self._counting = False
            self.stats.compiles_after_prewarm = self.compiles

    def _run(self, until, campaign, progress) -> RunStats:
        pending: collections.deque = collections.deque()
        attempts: collections.Counter = collections.Counter()
        snapshot = None  # (slot, step, ticket) in flight
        # A snapshot copied but not yet trusted: (slot, step). The copy runs beside the next
        # step, and damage to the state it reads may land before or during the copy; the next
        # step reads the same slot and checks every chunk's digest, so the snapshot is marked
        # complete only once that step has committed (else it is taken again at the next step).
        unverified = None
        snapshot_due = False
        skipped_step, skips = None, 0  # the step skipped last, and how often in a row
        step = self.next_step
        if self.backup is not None and not self.backup.newest():
            # A first snapshot of the starting state, so that a host restore is always possible.
            slot = self.backup.slot_for_next()
            self.backup.begin(slot, step - 1)
            self._wait_snapshot((slot, step - 1, self._run_snapshot(slot)))
            self._complete_snapshot(slot)  # nothing ran beside it
        while step <= until or pending:
            if step <= until and len(pending) < 2:
                attempts[step] += 1
                self._poll_telemetry(step)
                gf = campaign.before_step(self, step, attempts[step]) if campaign else None
                loss, summary = self._guarded(step, lambda: self._dispatch(step, gf))
                scrub = None
                scheduled = bool(self.scrub_every and step % self.scrub_every == 0)
                if scheduled or self._scrub_due:
                    if campaign and scheduled:
                        campaign.before_scrub(self, step)
                    self._scrub_due = False
                    scrub = self._programs["scrub", self.state.opt.current](self.state)
                    self._settle(scrub)
                    scrub.copy_to_host_async()
                if (self.backup is not None and snapshot is None and unverified is None and
                        self.snapshot_every and (step % self.snapshot_every == 0 or snapshot_due)):
                    snapshot_due = False
                    slot = self.backup.slot_for_next()
                    self.backup.begin(slot, step)
                    snapshot = (slot, step, self._run_snapshot(slot))
                pending.append((step, loss, summary, scrub))
                step += 1
                continue
            done, loss, summary, scrub = pending.popleft()
            s = self._guarded(done, lambda: self._fetch(summary))  # [devices, summary]
            committed = bool(s[0, 0])  # the verdict is global: the same on every device
            if snapshot is not None and snapshot[1] == done:
                self._wait_snapshot(snapshot)  # the copy is done before the slot is rewritten
                unverified = snapshot[:2] if committed else None
                snapshot_due, snapshot = not committed, None
            elif unverified is not None and unverified[1] + 1 == done:
                if committed:
                    self._complete_snapshot(unverified[0])
                snapshot_due, unverified = not committed, None
            if committed:
                skipped_step = None
                self.stats.steps_committed += 1
                self.stats.losses[done] = float(self._fetch(loss))
                self.next_step = done + 1
                if scrub is not None:
                    self._handle_scrub(done, self._fetch(scrub))
                if progress:
                    progress(done, self.stats)
                continue
            # A skipped step: every step dispatched after it skipped too (halt flag); their
            # summaries may name more damage (injected while they were in flight).
            self.stats.steps_skipped += 1 + len(pending)
            later = [(t, self._fetch(later_summary)) for t, _, later_summary, _ in pending]
            jax.block_until_ready([scrub] + [p[3] for p in pending])  # readers of the state
            pending.clear()
            if snapshot is not None:
                self._wait_snapshot(snapshot)
                snapshot, snapshot_due = None, True
            skips = skips + 1 if skipped_step == done else 1
            skipped_step, seen = done, len(self.stats.incidents)
            replay_from = self._handle_fault([(done, s)] + later)
            if skips >= self.max_skips:
                raise self._persistent(done, skips, s, self.stats.incidents[seen:])
            self.stats.steps_replayed += step - replay_from
            step = replay_from
        if snapshot is not None:
            self._wait_snapshot(snapshot)
            unverified = snapshot[:2]
        if unverified is not None and self._current_slot_verifies():
            self._complete_snapshot(unverified[0])  # no step after it: a scrub checks its slot
        return self.stats

    # -- hardware telemetry --------------------------------------------------------------------

    def _map_nvml_devices(self, devices) -> dict[int, int]:
        """NVML index -> position in ``devices``: by UUID for GPUs (CUDA ordinals and NVML
        indices differ under CUDA_VISIBLE_DEVICES); else index i is position i."""
        t = self.telemetry
        if t is None or not t.available:
            return {}
        by_uuid = {d.uuid: d.index for d in t.devices if d.uuid}
        cuda = pimhbm._core.cuda_device_uuids()
        out = {}
        for pos, dev in enumerate(devices):
            hw = getattr(dev, "local_hardware_id", None)
            if (dev.platform == "gpu" and dev.process_index == jax.process_index() and
                    hw is not None and hw < len(cuda) and cuda[hw] in by_uuid):
                out[by_uuid[cuda[hw]]] = pos
        if not out:
            out = {i: i for i in range(min(len(t.devices), len(devices)))}
        return out

    def _telemetry_status(self) -> str:
        return "off" if self.telemetry is None else self.telemetry.status()

    def _poll_telemetry(self, step: int) -> None:
        """Between steps: what the GPUs reported since the last step (no NVML call here). A
        device with news becomes suspect and its state is scrubbed at this step; a fatal
        event stops the run with DeviceFailure (resume from the host snapshot)."""
        if self.telemetry is None:
            return
        for e in self.telemetry.drain():
            pos = self._nvml_position.get(e.device)
            self.stats.telemetry_events.append(e)
            where = f"device {pos}" if pos is not None else f"NVML device {e.device} (not in this run)"
            if e.fatal:
                raise DeviceFailure(self._failure_message(f"{where}: {e.describe()}"), pos,
                                    self._newest_snapshot())
            if pos is None:
                continue
            self.stats.suspect_devices.add(pos)
            self._scrub_due = True
            self.stats.incidents.append(Incident(step, "telemetry", [],
                                                 f"{where}: {e.describe()}; full scrub at step {step}"))

    def _newest_snapshot(self) -> int | None:
        if self.backup is None:
            return None
        newest = self.backup.newest()
        return newest[0][0] if newest else None

    def _failure_message(self, what: str) -> str:
        snap = self._newest_snapshot()
        how = ("restart the process and resume from the host snapshot of step "
               f"{snap} (Trainer(..., shm_name={self.backup.name!r}, resume=True))"
               if snap is not None else
               "there is no host snapshot to resume from (pass shm_name= to keep one)")
        return f"{what}. This process cannot use the device again: {how}."

    def _guarded(self, step: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn``; a device error (a poisoned CUDA context after an uncorrectable ECC
        error, a lost GPU) becomes DeviceFailure with the way to resume, not a hang."""
        try:
            return fn()
        except jax.errors.JaxRuntimeError as err:
            raise DeviceFailure(self._failure_message(f"step {step}: device error: {err}"), None,
                                self._newest_snapshot()) from err

    # -- handling faults -----------------------------------------------------------------------

    def _locate(self, idx: int, bits: int, shift: int = 0,
                device: int = 0) -> list[tuple[int, str, str, int]]:
        leaf = int(np.searchsorted(self.chunk_base, idx, side="right") - 1)
        chunk = idx - int(self.chunk_base[leaf])
        return [(device, self.paths[leaf], k, chunk) for k in self.names
                if (bits >> shift) & TENSOR_BIT[k]]

    def _decode(self, values: np.ndarray) -> list[tuple[int, int]]:
        k = self.fault_capacity
        return [(int(i), int(b)) for i, b in zip(values[:k], values[k:2 * k]) if i >= 0]

    def _handle_fault(self, summaries: list[tuple[int, np.ndarray]]) -> int:
        """Repairs after the skipped steps (the first, and those halted behind it; each summary
        has a row per device); returns the step to resume from."""
        k = self.fault_capacity
        first = summaries[0][0]
        state_faults: dict[int, int] = {}  # chunk -> bits, over every device
        overflow = False
        damaged: set[tuple[int, str, str, int]] = set()  # (device, leaf, tensor, chunk)
        for step, rows in summaries:
            locs, grad_locs, unlisted = [], [], False
            for device, s in enumerate(rows):
                faults = self._decode(s[3:3 + 2 * k])
                overflow |= int(s[2]) > len(faults)
                for i, b in faults:
                    state_faults[i] = state_faults.get(i, 0) | b
                    locs += self._locate(i, b, device=device)
                grads = self._decode(s[3 + 2 * k:3 + 4 * k])
                unlisted |= int(s[1]) > sum(c for _, c in grads)
                for i, _ in grads:
                    grad_locs.append((device, self._locate(i, 1)[0][1], "gradient", self._chunk_of(i)))
            damaged.update(locs)
            if locs:  # every damaged chunk this step saw (damage persists until repaired)
                self.stats.incidents.append(Incident(step, "state", locs, ""))
            if grad_locs:
                self.stats.incidents.append(Incident(
                    step, "gradient", grad_locs, "step skipped, replayed", unlisted=unlisted))
        pending_state = [inc for inc in self.stats.incidents if inc.kind == "state" and not inc.action]
        if state_faults:
            failures: list[tuple[int, str, str, int]] = []
            action = "repaired from the device copy"
            if not overflow and not self.device_copy:  # every chunk from another replica
                action = self._repair_from_replicas(sorted(damaged))
            elif not overflow and not self._repair(sorted(state_faults.items()), into_copy=False,
                                                   failures=failures):
                # The device copy is damaged too (a double fault): another device's copy of
                # the state, current to the same step, before the host snapshot and a replay.
                action = self._repair_from_replicas(failures)
            if (overflow or action is None) and not self._state_lost:
                # Too much damage to list (a lost shard) or no intact copy of some chunk: the
                # whole state from a device that saw no damage at all, else the host snapshot.
                action = self._rebuild_from_replica(summaries)
            if action is None:
                snap_step = self._restore_from_host()
                for inc in pending_state:
                    inc.action = f"restored from host snapshot @{snap_step}"
                return snap_step + 1
            for inc in pending_state:
                inc.action = action
        self.state = TrainState(self.state.opt, self._put(np.int32(0)))
        return first

    def _persistent(self, step: int, skips: int, rows: np.ndarray,
                    incidents: list[Incident]) -> PersistentFault:
        """What to tell a user whose step never commits, from the last skip's summary."""
        what = []
        nonfinite, damaged = int(rows[:, 1].sum()), int(rows[:, 2].sum())
        if nonfinite:
            grads = [loc for inc in incidents if inc.kind == "gradient" for loc in inc.locations]
            where = ", ".join(f"{p} chunk {c}" for _, p, _, c in grads[:3])
            what.append(f"{nonfinite} non-finite gradient values" + (f" (in {where}, ...)" if where else ""))
        if damaged:
            locs = [loc for inc in incidents if inc.kind == "state" for loc in inc.locations]
            where = ", ".join(f"{p}/{t} chunk {c} on device {d}" for d, p, t, c in locs[:3])
            what.append(f"{damaged} state chunks whose digest did not match" +
                        (f" ({where}, ...)" if where else ""))
        hint = ("A gradient that is non-finite on its own is no fault: the loss diverged or the "
                "batch holds bad values (check the learning rate, the data and the loss)"
                if nonfinite and not damaged else
                "State that fails its digest again after each repair points at a device that "
                "computes or stores wrongly (see `pimhbm health`)")
        return PersistentFault(
            f"step {step} was skipped {skips} times in a row, every replay reporting "
            f"{' and '.join(what) or 'a fault'}. Faults are transient; this comes back on every "
            f"replay. {hint}.", step, skips, incidents)

    def _chunk_of(self, idx: int) -> int:
        leaf = int(np.searchsorted(self.chunk_base, idx, side="right") - 1)
        return idx - int(self.chunk_base[leaf])

    def _repair(self, faults: list[tuple[int, int]], *, into_copy: bool, shift: int = 0,
                failures: list[tuple[int, str, str, int]] | None = None) -> bool:
        """Repairs the listed (chunk, bits); True if every chunk verified afterwards. The
        (device, leaf, tensor, chunk) that did not are added to ``failures``."""
        # Every device repairs the same chunks of its copy: where a device's chunk is intact
        # the repair rewrites the same bytes.
        work = sorted({loc[1:] for i, b in faults for loc in self._locate(i, b, shift)})
        ok = True
        for lists, batch in self._batches(work):
            program = self._programs["repair", self.state.opt.current, into_copy]
            self.state, status = program(self.state, self._put(lists))
            status = self._fetch(status)  # [devices, leaves, tensors, capacity]
            self.stats.repairs += int(np.sum(status[0] == pimhbm.REPAIRED))
            bad = (lists[None] >= 0) & (status != pimhbm.REPAIRED)
            if np.any(bad):
                ok = False
                if failures is not None:
                    for d, li, ti, r in zip(*np.nonzero(bad)):
                        failures.append((int(d), self.paths[li], self.names[ti], int(lists[li, ti, r])))
        return ok

    def _batches(self, work: list[tuple[str, str, int]]):
        """(lists, entries) in batches of repair_capacity chunks per tensor."""
        while work:
            lists = np.full((len(self.paths), len(self.names), self.repair_capacity), -1, np.int32)
            fill = collections.Counter()
            batch, rest = [], []
            for entry in work:
                path, k, chunk = entry[:3]
                li, ti = self.paths.index(path), self.names.index(k)
                if fill[li, ti] < self.repair_capacity:
                    lists[li, ti, fill[li, ti]] = chunk
                    fill[li, ti] += 1
                    batch.append(entry)
                else:
                    rest.append(entry)
            yield lists, batch
            work = rest

    def _pull_by_ipc(self, work: list, damaged: dict, *, repairs: bool = True) -> set[int]:
        """The chunks of ``work`` pulled into every damaged replica over CUDA IPC (pimhbm.ipc),
        straight into the current slot's buffers; returns the source devices. ``repairs``:
        count the chunks as repairs (not for a whole state rebuilt)."""
        # Nothing of the state is still written (its last writers) or read (the steps' and
        # scrubs' results were waited for before the fault was handled; snapshots too).
        jax.block_until_ready(self.state)
        self._ipc_round += 1
        cur = slot_tensors(self.state.opt.slots[self.state.opt.current], self.treedef)
        by_pair: dict[tuple, list[int]] = collections.defaultdict(list)
        for col, path, k, chunk, row in work:
            for target in sorted(damaged[col, path, k, chunk]):
                by_pair[row, target, col, path, k].append(chunk)
        pulls = []
        for (row, target, col, path, k), chunks in sorted(by_pair.items()):
            t = cur[self.paths.index(path)][k]
            pulls.append(ipc.Pull(f"{row}.{target}.{col}.{path}.{k}", self.mesh.devices[row, col],
                                  self.mesh.devices[target, col], chunks, t, t,
                                  self.opt.chunk_bytes(t[0].dtype)))
        pulled = ipc.run_round(self._ipc_run, self._ipc_round, pulls,
                               int(self.replica_timeout_s * 1000))
        self.stats.repairs += pulled if repairs else 0
        self.stats.ipc_pulls += pulled
        return {row * self.shard + col for row, _, col, _, _ in by_pair}

    def _rebuild_from_replica(self, summaries: list[tuple[int, np.ndarray]]) -> str | None:
        """The whole state of every damaged device rebuilt from a device that reported no
        damage in any of ``summaries``; None when there is no such device (or one device)."""
        if len(self.devices) < 2 or "rebuild" not in {k[0] for k in self._programs}:
            return None
        damaged = np.zeros(len(self.devices), np.int32)
        for _, rows in summaries:
            damaged |= (rows[:, 2] > 0).astype(np.int32)  # faulty chunks seen by each device
        grid = damaged.reshape(self.mesh.devices.shape)  # (replica, shard column)
        sources = np.zeros(self.shard, np.int32)
        for col in range(self.shard):
            clean = np.flatnonzero(grid[:, col] == 0)
            if clean.size == 0:
                return None
            sources[col] = clean[0]
        try:
            by_ipc = self._rebuild_by_ipc(grid, sources)
        except DeviceFailure:
            raise
        except RuntimeError as err:  # a pulled chunk did not verify, or a program failed (a
            return self._replica_failed(err)  # JaxRuntimeError): the host snapshot, as below
        if not by_ipc:
            program = self._programs["rebuild", self.state.opt.current]
            try:
                self.state, bad = program(self.state,
                                          self._put(sources, self.by_column),
                                          self._put(grid, self.grid))
                bad = self._fetch(bad)
            except jax.errors.JaxRuntimeError as err:
                return self._replica_failed(err)
            if bad.any():
                return None
        self.stats.replica_rebuilds += int(damaged.sum())
        devices = ", ".join(map(str, np.flatnonzero(damaged)))
        used = sorted({int(sources[d % self.shard]) * self.shard + d % self.shard
                       for d in np.flatnonzero(damaged)})
        return (f"repaired: device {devices} rebuilt whole from a healthy replica (device "
                f"{', '.join(map(str, used))})")

    def _over_ipc(self, what: str, pull: Callable[[], Any]) -> Any:
        """``pull()`` (a round of CUDA IPC pulls) and its result; None when IPC cannot serve
        this run (said once; the collective transport from then on). A round that did not
        finish raises DeviceFailure (a pull may still be writing the state: stop here); one
        whose chunk did not verify raises RuntimeError (the caller's host snapshot)."""
        try:
            return pull()
        except ipc.Unavailable as err:
            self._ipc_off = str(err)
            self.stats.incidents.append(Incident(
                self.next_step, "replica transport", [],
                f"CUDA IPC unavailable ({err}); the collective transport from now on"))
            return None
        except ipc.Fatal as err:
            raise DeviceFailure(self._failure_message(f"{what} over CUDA IPC: {err}"), None,
                                self._newest_snapshot()) from err

    def _rebuild_by_ipc(self, grid: np.ndarray, sources: np.ndarray) -> bool:
        """With the IPC transport, every chunk of every tensor of each damaged device (``grid``
        (replica, shard column), 1 = damaged) pulled over CUDA IPC from replica
        ``sources[column]``, then its device copy made anew from it. False when the transport
        is not IPC or IPC cannot serve this run (the caller then rebuilds through the
        collective program); a pull that does not verify or does not finish raises as in a
        repair."""
        if self.replica_transport != "ipc" or self._ipc_off is not None:
            return False
        if self.device_copy and ("recopy", self.state.opt.current) not in self._programs:
            return False  # (prewarm compiles it wherever a rebuild can happen)
        work, damaged = [], {}
        for row, col in zip(*np.nonzero(grid)):
            for li, path in enumerate(self.paths):
                for k in self.names:
                    for chunk in range(int(self.nchunks[li])):
                        key = (int(col), path, k, chunk)
                        if key not in damaged:
                            damaged[key] = set()
                            work.append((*key, int(sources[col])))
                        damaged[key].add(int(row))
        if self._over_ipc("rebuild from a replica",
                          lambda: self._pull_by_ipc(work, damaged, repairs=False)) is None:
            return False
        if self.device_copy:
            self.state = self._programs["recopy", self.state.opt.current](
                self.state, self._put(grid.astype(np.int32), self.grid))
        return True

    def _replica_failed(self, err: Exception) -> None:
        """A replica transfer failed (a peer that did not answer within the peer ops' bounded
        wait, a collective error): the state it was given is gone (donated), so the fallback
        is the host snapshot and a replay. Returns None (no action)."""
        self._state_lost = True
        self.stats.incidents.append(Incident(self.next_step, "replica transport", [],
                                             f"failed ({str(err).splitlines()[0][:200]}); "
                                             "falling back to the host snapshot"))
        return None

    def _repair_from_replicas(self, failures: list[tuple[int, str, str, int]]) -> str | None:
        """Chunks that a device could not repair from its own device copy (without device
        copies: every damaged chunk), pulled from a device whose copy of them is healthy; then
        that device copy (if any) is rewritten from the repaired state. Returns the action's description, or None when some chunk has no
        healthy copy on any device (or there is one device)."""
        if len(self.devices) < 2 or "replica" not in {k[0] for k in self._programs}:
            return None
        # Per shard column, the replicas (rows) whose chunk failed; the source is another row.
        damaged: dict[tuple[int, str, str, int], set[int]] = collections.defaultdict(set)
        for d, path, k, chunk in failures:
            damaged[d % self.shard, path, k, chunk].add(d // self.shard)
        replicas = len(self.devices) // self.shard
        work = []
        for (col, path, k, chunk), rows in sorted(damaged.items()):
            healthy = [r for r in range(replicas) if r not in rows]
            if not healthy:
                return None
            work.append((col, path, k, chunk, healthy[0]))
        sources = set()
        if self.replica_transport == "ipc" and self._ipc_off is None:
            try:
                pulled = self._over_ipc("repair from a replica",
                                        lambda: self._pull_by_ipc(work, damaged))
            except DeviceFailure:
                raise
            except RuntimeError as err:  # a pulled chunk did not verify: host snapshot
                return self._replica_failed(err)
            if pulled is not None:
                sources, work = pulled, []  # every chunk pulled and verified
        while work:
            lists = np.full((self.shard, len(self.paths), len(self.names), self.repair_capacity),
                            -1, np.int32)
            src = np.zeros_like(lists)
            fill = collections.Counter()
            batch, rest = [], []
            for entry in work:
                col, path, k, chunk, row = entry
                li, ti = self.paths.index(path), self.names.index(k)
                slot = fill[col, li, ti]
                if slot < self.repair_capacity:
                    lists[col, li, ti, slot], src[col, li, ti, slot] = chunk, row
                    fill[col, li, ti] += 1
                    batch.append((entry, slot))
                    sources.add(row * self.shard + col)
                else:
                    rest.append(entry)
            program = self._programs["replica", self.state.opt.current]
            try:
                self.state, status = program(self.state, self._put(lists, self.by_column),
                                             self._put(src, self.by_column))
                status = self._fetch(status)  # [devices, leaves, tensors, capacity]
            except jax.errors.JaxRuntimeError as err:
                return self._replica_failed(err)
            for (col, path, k, chunk, row), slot in batch:
                li, ti = self.paths.index(path), self.names.index(k)
                others = [r * self.shard + col for r in range(replicas) if r != row]
                if any(status[d, li, ti, slot] != pimhbm.REPAIRED for d in others):
                    return None
                self.stats.repairs += 1
            work = rest
        if self.device_copy:
            # The device copies of those chunks: from the repaired state (an intact copy gets
            # the same bytes again).
            copy_faults = [(int(self.chunk_base[self.paths.index(path)]) + chunk,
                            TENSOR_BIT[k] << 4) for col, path, k, chunk in damaged]
            if not self._repair(copy_faults, into_copy=True, shift=4):
                return None
        self.stats.replica_repairs += len(damaged)
        return f"repaired from a healthy replica (device {', '.join(map(str, sorted(sources)))})"

    def _handle_scrub(self, step: int, rows: np.ndarray) -> None:
        self.stats.scrubs += 1
        copy_faults, locs = {}, []
        for device, values in enumerate(rows):
            for i, b in self._decode(values):
                if b >> 4:
                    copy_faults[i] = copy_faults.get(i, 0) | b
                    locs += self._locate(i, b, 4, device=device)
        if not copy_faults:
            return
        copy_faults = sorted(copy_faults.items())
        ok = self._repair(copy_faults, into_copy=True, shift=4)
        self.stats.incidents.append(Incident(step, "device copy", locs,
                                             "device copy repaired from the current state" if ok
                                             else "device copy repair failed"))

    # -- host snapshots ------------------------------------------------------------------------

    def _wait_snapshot(self, snapshot) -> None:
        """Returns once the snapshot's copies to the host are done."""
        jax.block_until_ready(snapshot[2])
        pimhbm._core.snapshot_wait()

    def _complete_snapshot(self, slot: int) -> None:
        self.backup.complete(slot)
        self.stats.snapshots += 1

    def _current_slot_verifies(self) -> bool:
        """A scrub of the current state: whether every chunk of the current slot verifies."""
        rows = self._fetch(self._scrub_program(self.state.opt.current)(self.state))
        return not any(b & 0xF for r in rows for _, b in self._decode(r))

    def _load_snapshot(self) -> int:
        """Puts the newest snapshot that verifies into every copy of the state; returns its
        step. Raises if there is none."""
        for step, slot in self.backup.newest():
            views = self.backup.snapshot_arrays(slot)
            leaves = []
            it = iter(views)
            for _ in self.paths:
                leaves.append({k: (next(it), next(it)) for k in self.names})
            # Each process puts the parts its devices hold, once; the other slot and the device
            # copy are made from it on the devices; the digests are checked there (the scrub).
            where = [NamedSharding(self.mesh, spec) for spec in self._leaf_specs]
            first = slot_from_tensors([{k: tuple(self._put(x, w, copy=True) for x in v)
                                        for k, v in leaf.items()}
                                       for leaf, w in zip(leaves, where)], self.treedef)
            other, mirror = self._clone_program()(first)
            opt = AdamWState((first, other), 0, self._put(np.int32(step)), mirror)
            state = TrainState(opt, self._put(np.int32(0)))
            rows = self._fetch(self._scrub_program(0)(state))
            self.backup.pin_rest_in_background()  # the puts are done (the scrub read them)
            if any(self._decode(r) for r in rows):
                continue  # this snapshot does not verify: an older one
            self.state = state
            return step
        raise RuntimeError("no host snapshot verifies: cannot restore")

    def _restore_from_host(self) -> int:
        self._state_lost = False
        if self.backup is None:
            raise RuntimeError("the device copy is damaged too and there is no host snapshot "
                               "(pass shm_name= to keep one)")
        step = self._load_snapshot()
        self.stats.host_restores += 1
        return step

    def resume(self) -> int:
        """After a crash: the state from the newest host snapshot; the run goes on (and replays
        the logged batches) from the step after it. Returns that snapshot's step."""
        if self.backup is None:
            raise RuntimeError("resume needs the shared-memory backup (shm_name=)")
        step = self._load_snapshot()
        self.next_step = step + 1
        return step

    # -- fault injection into the live state (campaigns, tests) ---------------------------------

    def inject(self, path: str, tensor: str, fault: np.ndarray, *, into_copy: bool = False,
               device: int | None = None) -> None:
        """Applies ``fault`` (pimhbm.faults.spec) in place to one tensor of the current slot (or
        of the device copy), on one device's copy or shard (``device``: its position in the
        mesh, row-major) or on every device's; offsets are within a device's shard."""
        opt = self.state.opt
        if into_copy and opt.device_copy is None:
            raise ValueError("this run keeps no device copy (pimhbm.adamw(device_copy=False))")
        slot = opt.device_copy if into_copy else opt.slots[opt.current]
        leaves = slot_tensors(slot, self.treedef)
        i = self.paths.index(path)
        t, table = leaves[i][tensor]
        specs = np.zeros((len(self.devices), 8), np.int32)
        specs[slice(None) if device is None else device] = fault
        spec = self._leaf_specs[i]
        t = self._inject_program(t.shape, t.dtype, spec)(t, self._put(specs, self.by_device))
        self._settle(t)
        leaves[i][tensor] = (t, table)
        new = slot_from_tensors(leaves, self.treedef)
        opt = (AdamWState(opt.slots, opt.current, opt.step, new) if into_copy
               else opt.replace_current(new))
        self.state = TrainState(opt, self.state.halted)

    def tensor_info(self) -> list[tuple[str, str, int, int]]:
        """(leaf path, tensor, elements on one device, bytes per element) of every protected
        tensor (a sharded tensor: the elements of one shard)."""
        out = []
        for path, p, n in zip(self.paths, jax.tree.leaves(self.state.opt.params), self.sizes):
            for k in self.names:
                out.append((path, k, n, jnp.dtype(tensor_dtype(k, p.dtype)).itemsize))
        return out

    # -- results -------------------------------------------------------------------------------

    def current_state(self) -> dict[str, np.ndarray]:
        """The committed state as host arrays, by leaf and tensor (for comparisons)."""
        out = {}
        opt = self.state.opt  # whole tensors (a sharded one assembled from its shards)
        whole = np.asarray
        if self.multiprocess:  # a collective: every process calls it
            from jax.experimental import multihost_utils
            whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for path, leaf in zip(self.paths, slot_tensors(opt.slots[opt.current], self.treedef)):
            for k in self.names:
                out[f"{path}/{k}"] = whole(leaf[k][0])
        return out

    def close(self, unlink: bool = False) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        if self.replica_transport == "ipc" and self._ipc_round:
            pimhbm._core.ipc_close()  # the peers' memory this process mapped
        if self.backup is not None and unlink:
            HostBackup.unlink(self.backup.name)

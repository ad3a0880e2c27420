"""The functions the engine compiles, each one device's part inside shard_map over the mesh:
the step, the repairs (from the device copy, from a replica, a whole device rebuilt), the scrub,
the host snapshot, fault injection -- and the shapes and shardings of the state they trace."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pimhbm
from pimhbm import faults, replica
from pimhbm.recovery.layout import Damage, StateLayout, Vote
from pimhbm.recovery.placement import AXES, Placement, Transport
from pimhbm.recovery.summary import ScrubSummary, fault_list, step_summary
from pimhbm.update import (AdamW, AdamWState, Slot, restore_unless, slot_from_tensors,
                           slot_tensors, step_copies_of)


class TrainState(NamedTuple):
    opt: AdamWState
    # int32: a step was skipped and not yet replayed, and later steps skip too. Set, it holds
    # HALTED (every bit), so that no single flipped bit clears it; a flip that sets a bit of a
    # clear flag only skips steps the engine then replays.
    halted: jax.Array


HALTED = -1


def _after(x: jax.Array, previous: jax.Array | None) -> jax.Array:
    """``x``, available only once ``previous`` is: the peer ops of a program must run in the
    same order on every device (each meets its peers on the host), and XLA's CPU runtime may
    otherwise run independent ops in a different order on each device -- every device then
    waits at a different meeting until the timeout."""
    return x if previous is None else jax.lax.optimization_barrier((x, previous))[0]


def _with_copy(opt: AdamWState, device_copy: Slot | None) -> AdamWState:
    return AdamWState(opt.slots, opt.current, opt.step_copies, device_copy)


def _copy_of_rebuilt(slot: Slot, device_copy: Slot | None, take: jax.Array) -> Slot | None:
    """The device copy of a rebuilt device: the same as its new current slot (after a commit the
    copy equals the state; nothing committed since); elsewhere unchanged."""
    if device_copy is None:
        return None
    return jax.tree.map(lambda n, m: jnp.where(take, n, m), slot, device_copy)


@dataclasses.dataclass(frozen=True)
class Traced:
    """What the traced functions close over (static for the life of a Trainer)."""

    loss_fn: Callable[[Any, Any], jax.Array]
    opt: AdamW
    treedef: Any
    layout: StateLayout
    placement: Placement
    fault_capacity: int
    inject_gradients: bool
    inject_local: bool  # the hook also before the reduction (a fault on one device's gradients)
    transport: Transport  # how a chunk comes from another replica

    # -- shapes and shardings --------------------------------------------------------------------

    @property
    def leaf_specs(self) -> list[P]:
        return [P("shard") if sh else P() for sh in self.layout.sharded]

    @property
    def param_specs(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaf_specs)

    def slot_specs(self) -> Slot:
        """The PartitionSpecs of a Slot: each tensor and digest table as its parameter."""
        ps = self.param_specs
        tables = jax.tree.map(lambda spec: {k: spec for k in self.layout.names}, ps,
                              is_leaf=lambda x: isinstance(x, P))
        return Slot(ps, ps if self.opt.master_weights else None, ps, ps, tables)

    def state_specs(self, current: int = 0) -> TrainState:
        slot = self.slot_specs()
        copy = slot if self.opt.device_copy else None
        return TrainState(AdamWState((slot, slot), current, P(), copy), P())

    # -- the step --------------------------------------------------------------------------------

    def step(self, state: TrainState, batch: dict, lr: jax.Array, grad_fault: jax.Array, *,
             digests: bool = False):
        """Gradients of this device's slice of the batch, their mean over devices, the guarded
        update with a global verdict; the loss and this device's summary -- and, ``digests``
        (a sampled step), the digests of this device's own gradients before the reduction,
        for :meth:`recheck` to compare with."""
        local, loss = self._local_gradients(state.opt.params, batch, grad_fault)
        own = self._digests(local)[None] if digests else None
        grads = self._reduce(local)
        if self.inject_gradients:  # what every replica then sees (grad_fault[1] == -1)
            grads = self._hook(grads, grad_fault, grad_fault[1] < 0)
        lr = None if callable(self.opt.learning_rate) else lr
        gate = state.halted == 0
        disagree = self._disagreement(state.opt)
        if disagree:  # the replicas' states differ: nothing commits until they agree again
            count = sum(jnp.sum(m != 0, dtype=jnp.int32) for m in disagree)
            gate &= jax.lax.psum(count, AXES) == 0
        opt, report = self.opt.update(grads, state.opt, lr, gate=gate, axis_name=AXES)
        halted = state.halted | jnp.where(report.committed, 0, HALTED)
        summary = step_summary(report, self.treedef, self.fault_capacity, disagree)
        out = TrainState(opt, halted), jax.lax.psum(loss, AXES), self.placement.per_device(summary)
        return out if own is None else (*out, own)

    def _hook(self, grads: Any, grad_fault: jax.Array, here: jax.Array) -> Any:
        """The campaign's gradient fault (pimhbm.faults.GradientFault, encoded) where ``here``."""
        leaves = self.treedef.flatten_up_to(grads)
        chosen = (jnp.arange(len(leaves))[:, None] == grad_fault[0]) & here
        spec = jnp.where(chosen, grad_fault[2:], jnp.zeros((8,), jnp.int32))
        return jax.tree.unflatten(self.treedef, [
            faults.inject_in_graph(g, spec[i]) for i, g in enumerate(leaves)])

    def _digests(self, grads: Any) -> jax.Array:
        """uint32 (leaves, 2): one digest of each whole gradient leaf (pimhbm.scan)."""
        rows = []
        for g in self.treedef.flatten_up_to(grads):
            whole = max(16, -(-g.size * g.dtype.itemsize // 16) * 16)
            table = pimhbm.scan(g, whole).digests
            rows.append(table[0] if table.shape[0] else jnp.zeros((2,), jnp.uint32))
        return jnp.stack(rows)

    def _disagreement(self, opt: AdamWState) -> list[jax.Array]:
        """Per leaf, the Damage bits of the tensors whose chunk's digest differs between the
        replicas (along 'dp'; the same map on every replica of a shard column). Every replica
        holds the same state by construction: a chunk that differs there, and matches its own
        digest, was changed together with its digest -- a wrong computation. Empty without
        replicas. One reduction of the digest tables (8 bytes a chunk and tensor), not of the
        state."""
        if self.placement.replicas < 2:
            return []
        leaves = slot_tensors(opt.slots[opt.current], self.treedef)
        flat = jnp.concatenate([leaf[k][1].reshape(-1) for leaf in leaves
                                for k in self.layout.names])
        # One reduction for both ends: the max of ~x is ~(the min of x).
        ends = jax.lax.pmax(jnp.concatenate([flat, ~flat]), "dp")
        differs = ends[:flat.shape[0]] != ~ends[flat.shape[0]:]
        maps, at = [], 0
        for leaf in leaves:
            acc = jnp.zeros((leaf["p"][1].shape[0],), jnp.int32)
            for k in self.layout.names:
                n = leaf[k][1].shape[0]
                chunk_differs = differs[at:at + 2 * n].reshape(n, 2).any(axis=1)
                acc |= chunk_differs.astype(jnp.int32) * int(Damage.of(k))
                at += 2 * n
            maps.append(acc)
        return maps

    def _local_gradients(self, params: Any, batch: dict,
                         grad_fault: jax.Array | None) -> tuple[Any, jax.Array]:
        """This device's gradients of its slice of the batch (before any reduction) and its part
        of the mean loss; with a sharding axis (FSDP) the sharded parameters are gathered for
        the forward pass. With the campaign's hook, a fault meant for this device before the
        reduction goes in here."""
        # The mean over devices is taken on the loss, before differentiation: its 1/n then
        # scales the backward pass's seed, and the summed gradients need no pass of their own
        # (a division after the psum is an elementwise pass over every gradient that XLA cannot
        # fuse into the update's custom call: 0.7 ms a step for 0.5 B bf16 gradients).
        n = len(self.placement.devices)
        if self.layout.shard > 1:
            local = self.treedef.flatten_up_to(params)
            params = jax.tree.unflatten(self.treedef, [
                jax.lax.all_gather(p, "shard", axis=0, tiled=True) if sh else p
                for p, sh in zip(local, self.layout.sharded)])
        loss, grads = jax.value_and_grad(lambda p: self.loss_fn(p, batch) / n)(params)
        if self.inject_local and grad_fault is not None:
            grads = self._hook(grads, grad_fault, grad_fault[1] == jax.lax.axis_index(AXES))
        return grads, loss

    def _reduce(self, grads: Any) -> Any:
        """The sum over devices (the whole batch's mean: the loss was scaled); with FSDP the
        sharded leaves' sums reduce-scattered back to their shards."""
        if self.layout.shard == 1:
            return jax.lax.psum(grads, "dp")
        return jax.tree.unflatten(self.treedef, [
            jax.lax.psum(jax.lax.psum_scatter(g, "shard", scatter_dimension=0, tiled=True)
                         if sh else jax.lax.psum(g, "shard"), "dp")
            for g, sh in zip(self.treedef.flatten_up_to(grads), self.layout.sharded)])

    def recheck(self, state: TrainState, batch: dict, committed: jax.Array,
                digests: jax.Array) -> tuple[TrainState, jax.Array]:
        """A sampled step computed again: each device recomputes the gradients of the next
        device's slice of the batch (its own, alone) from the parameters the step read (the
        other slot), and their digests go back to the slice's device to be compared with the
        step's (``digests``). Where any differs the step is undone -- the state the step read
        copied back into the current slot and the device copy, the step count put back, the
        halt flag set -- and the slice's device reports it. Returns the state and, per device,
        the gradient leaves whose digests differ."""
        n = len(self.placement.devices)
        ahead = [((i + 1) % n, i) for i in range(n)]  # device i gets device i + 1's slice
        theirs = jax.tree.map(lambda x: jax.lax.ppermute(x, AXES, ahead), batch)
        opt = state.opt
        grads, _ = self._local_gradients(opt.slots[1 - opt.current].params, theirs, None)
        again = jax.lax.ppermute(self._digests(grads), AXES, [(b, a) for a, b in ahead])
        mismatched = jnp.sum(jnp.any(again != digests[0], axis=-1), dtype=jnp.int32)
        undo = jax.lax.psum(mismatched, AXES) > 0
        return self._undo(state, undo, committed[0]), self.placement.per_device(mismatched)

    def _undo(self, state: TrainState, undo: jax.Array, committed: jax.Array) -> TrainState:
        """Where ``undo``, the state as the step read it: the other slot copied back into the
        current one and into the device copy (a predicated copy: nothing moves otherwise)."""
        opt = state.opt
        keep = (~undo).astype(jnp.int32)
        read = [x for leaf in slot_tensors(opt.slots[1 - opt.current], self.treedef)
                for k in self.layout.names for x in leaf[k]]
        targets = [opt.slots[opt.current]] + ([opt.device_copy] if opt.device_copy else [])
        restored = []
        for slot in targets:
            flat = [x for leaf in slot_tensors(slot, self.treedef)
                    for k in self.layout.names for x in leaf[k]]
            back = iter(restore_unless(keep, read, flat))
            restored.append(slot_from_tensors([{k: (next(back), next(back))
                                                for k in self.layout.names}
                                               for _ in self.layout.paths], self.treedef))
        copy = restored[1] if opt.device_copy else None
        step = jnp.where(undo, opt.step - committed.astype(jnp.int32), opt.step)
        opt = AdamWState(opt.slots, opt.current, step_copies_of(step), copy).replace_current(restored[0])
        return TrainState(opt, state.halted | jnp.where(undo, HALTED, 0))

    # -- repairs -----------------------------------------------------------------------------------

    def repair(self, state: TrainState, lists: jax.Array, *, into_copy: bool):
        """Listed chunks (int32 (leaves, tensors, capacity)) of the current slot rewritten from
        the device copy -- or, ``into_copy``, of the device copy from the current slot."""
        opt = state.opt
        cur = slot_tensors(opt.slots[opt.current], self.treedef)
        copy = slot_tensors(opt.device_copy, self.treedef)
        src, dst = (cur, copy) if into_copy else (copy, cur)
        statuses, new = [], []
        for i, (s_leaf, d_leaf) in enumerate(zip(src, dst)):
            leaf = {}
            for j, k in enumerate(self.layout.names):
                leaf[k], status = pimhbm.repair(lists[i, j], s_leaf[k], d_leaf[k],
                                                self.layout.chunk_bytes(k, i))
                statuses.append(status)
            new.append(leaf)
        slot = slot_from_tensors(new, self.treedef)
        opt = _with_copy(opt, slot) if into_copy else opt.replace_current(slot)
        return TrainState(opt, state.halted), self.placement.per_device(
            jnp.stack(statuses).reshape(lists.shape))

    def replica(self, state: TrainState, lists: jax.Array, src: jax.Array):
        """Listed chunks of the current slot rewritten from another device's copy of the state
        (every copy is current to the last committed step). lists, src: int32 (shard, leaves,
        tensors, capacity), a row per shard column: the chunk, and the replica (index along
        'dp') whose copy of it is healthy. "collective": one psum of the chunks' raw bits and
        digest rows (pimhbm.replica); "peer": each device reads the chunk from the source's
        memory (pimhbm.peer.pull). Either way the received chunk is checked against the
        source's digest before it is written and the target after. Statuses per device
        (leaves, tensors, capacity); the source device's own entries are NOT_LISTED."""
        lists, src = lists[0], src[0]  # this device's shard column
        opt = state.opt
        statuses, new = [], []
        for i, leaf in enumerate(slot_tensors(opt.slots[opt.current], self.treedef)):
            out = {}
            for j, k in enumerate(self.layout.names):
                cb = self.layout.chunk_bytes(k, i)
                if self.transport.in_programs is Transport.PEER:
                    out[k], status = pimhbm.peer.pull(
                        _after(lists[i, j], statuses[-1] if statuses else None), src[i, j],
                        leaf[k], cb, "dp", self.placement.mesh)
                else:
                    out[k], status = replica.pull_collective(lists[i, j], src[i, j], leaf[k],
                                                             cb, "dp")
                statuses.append(status)
            new.append(out)
        opt = opt.replace_current(slot_from_tensors(new, self.treedef))
        return TrainState(opt, state.halted), self.placement.per_device(
            jnp.stack(statuses).reshape(lists.shape))

    def rebuild(self, state: TrainState, source: jax.Array, targets: jax.Array):
        """A whole state (current slot and device copy) rebuilt on the ``targets`` devices
        (int32 (dp, shard), 1 = rebuild) from replica ``source`` (int32 per shard column: an
        index along 'dp'). "peer": every chunk of every tensor pulled from the source's memory
        (each checked against the source's digest and its own after the copy); "collective":
        one psum of the raw bits of every tensor and digest table, checked after. Returns the
        state and, per device, the chunks of its current slot that are not good afterwards."""
        opt, source, take = state.opt, source[0], targets[0, 0] != 0
        new, bad, after = [], jnp.int32(0), None
        for i, leaf in enumerate(slot_tensors(opt.slots[opt.current], self.treedef)):
            out = {}
            for k in self.layout.names:
                (t, table), cb = leaf[k], self.layout.chunk_bytes(k, i)
                if self.transport.in_programs is Transport.PEER:
                    n = table.shape[0]
                    chunks = _after(jnp.where(take, jnp.arange(n, dtype=jnp.int32), -1), after)
                    (t, table), after = pimhbm.peer.pull(
                        chunks, jnp.full((n,), source, jnp.int32), (t, table), cb, "dp",
                        self.placement.mesh)
                    bad += jnp.sum(take & (after != pimhbm.REPAIRED), dtype=jnp.int32)
                else:
                    t, table = (replica.copy_whole(x, source, take, "dp") for x in (t, table))
                    bad += jnp.sum(pimhbm.verify(t, table, cb), dtype=jnp.int32)
                out[k] = (t, table)
            new.append(out)
        slot = slot_from_tensors(new, self.treedef)
        opt = _with_copy(opt, _copy_of_rebuilt(slot, opt.device_copy, take))
        return TrainState(opt.replace_current(slot), state.halted), self.placement.per_device(bad)

    def vote(self, state: TrainState, lists: jax.Array) -> jax.Array:
        """Where the replicas disagree, which of them holds the majority's chunk. lists: int32
        (shard, leaves, tensors, capacity), a row per shard column, -1 = none. Per device and
        listed chunk: Vote.MAJORITY (its digest is that of more than half the replicas),
        Vote.MINORITY, or Vote.NONE (no digest is held by more than half)."""
        lists, replicas = lists[0], self.placement.replicas
        opt, votes = state.opt, []
        for i, leaf in enumerate(slot_tensors(opt.slots[opt.current], self.treedef)):
            for j, k in enumerate(self.layout.names):
                table, chunks = leaf[k][1], lists[i, j]
                rows = table[jnp.clip(chunks, 0, max(table.shape[0] - 1, 0))]
                everyone = jax.lax.all_gather(rows, "dp")  # (replicas, capacity, 2)
                mine = jnp.sum(jnp.all(everyone == rows[None], axis=-1), axis=0)
                best = jax.lax.pmax(mine, "dp")
                votes.append(jnp.where(chunks < 0, int(Vote.UNLISTED), jnp.where(
                    2 * best <= replicas, int(Vote.NONE),
                    jnp.where(2 * mine > replicas, int(Vote.MAJORITY), int(Vote.MINORITY)))))
        return self.placement.per_device(jnp.stack(votes).reshape(lists.shape).astype(jnp.int32))

    def recopy(self, state: TrainState, targets: jax.Array) -> TrainState:
        """The device copy of the ``targets`` devices (int32 (dp, shard), 1 = yes) made anew
        from their current slot (after a whole state was pulled into it over CUDA IPC)."""
        opt, take = state.opt, targets[0, 0] != 0
        copy = _copy_of_rebuilt(opt.slots[opt.current], opt.device_copy, take)
        return TrainState(_with_copy(opt, copy), state.halted)

    # -- checks, snapshots, injection --------------------------------------------------------------

    def scrub(self, state: TrainState) -> ScrubSummary:
        """A full digest sweep of the current slot and the device copy: per chunk, the Damage
        of the current slot's tensors and of the copy's."""
        opt = state.opt
        cur_leaves = slot_tensors(opt.slots[opt.current], self.treedef)
        copies = ([None] * len(cur_leaves) if opt.device_copy is None
                  else slot_tensors(opt.device_copy, self.treedef))
        maps = []
        for i, (cur, copy) in enumerate(zip(cur_leaves, copies)):
            acc = jnp.zeros((cur["p"][1].shape[0],), jnp.int32)
            for k in self.layout.names:
                cb = self.layout.chunk_bytes(k, i)
                acc |= pimhbm.verify(*cur[k], cb).astype(jnp.int32) * int(Damage.of(k))
                if copy is not None:
                    acc |= pimhbm.verify(*copy[k], cb).astype(jnp.int32) * int(
                        Damage.of(k, in_copy=True))
            maps.append(acc)
        return self.placement.per_device(ScrubSummary(fault_list(maps, self.fault_capacity)))

    def snapshot(self, state: TrainState, *, backup: Any, slot: int, part: int) -> jax.Array:
        """Runs on this process's writer of shard column ``part``: it writes its shard of every
        sharded tensor (and, the first writer only, the replicated ones) to its place in the
        region (one writer per byte)."""
        opt = state.opt
        offsets = iter(backup.offsets(slot))
        first = part == min(self.placement.writers)
        tensors, where = [], []
        for leaf, sharded in zip(slot_tensors(opt.slots[opt.current], self.treedef),
                                 self.layout.sharded):
            for k in self.layout.names:
                for x in leaf[k]:
                    offset = next(offsets)
                    if sharded or first:
                        tensors.append(x)
                        where.append(offset + (part * x.size * x.dtype.itemsize if sharded else 0))
        return pimhbm.backup_snapshot(tensors, backup.region, where)

    def clone(self, slot: Slot) -> tuple[Slot, Slot | None]:
        """Two more copies of a slot: the other slot, and the device copy (if any)."""
        return (jax.tree.map(jnp.copy, slot),
                jax.tree.map(jnp.copy, slot) if self.opt.device_copy else None)

    @staticmethod
    def inject(x: jax.Array, fault: jax.Array) -> jax.Array:
        """Fault injection into one device's copy (or shard) of a tensor, in place (a spec row
        per device; kind 0 leaves this copy alone)."""
        return faults.inject_in_graph(x, fault[0])

    @staticmethod
    def inject_rehashed(x: jax.Array, table: jax.Array, fault: jax.Array,
                        chunk_bytes: int) -> tuple[jax.Array, jax.Array]:
        """The same, and the damaged copy's digest table made anew from it: the state as a
        wrong computation would leave it (its digests match; only another replica's differ)."""
        x = faults.inject_in_graph(x, fault[0])
        return x, jnp.where(fault[0, 0] != 0, pimhbm.scan(x, chunk_bytes).digests, table)

"""The functions the engine compiles, each one device's part inside shard_map over the mesh:
the step, the repairs (from the device copy, from a replica, a whole device rebuilt), the scrub,
the host snapshot, fault injection -- and the shapes and shardings of the state they trace."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pimhbm
from pimhbm import faults, replica
from pimhbm.recovery.layout import Damage, StateLayout, Vote
from pimhbm.recovery.placement import AXES, Placement, Transport
from pimhbm.update import AdamW, AdamWState


class TrainState(NamedTuple):
    opt: AdamWState
    # int32: a step was skipped and not yet replayed, and later steps skip too. Set, it holds
    # HALTED (every bit), so that no single flipped bit clears it; a flip that sets a bit of a
    # clear flag only skips steps the engine then replays.
    halted: jax.Array
    # One copy of the state (pimhbm.inplace): the last step's chunks left for a redo
    # (pimhbm.inplace.LeftChunks, this device's); None with two slots.
    pending: Any = None


def slot_of(opt: Any) -> int:
    """The key of the programs that read ``opt``: its current slot's parity (two slots) or 0
    (one copy, updated in place)."""
    return opt.current if isinstance(opt, AdamWState) else 0


HALTED = -1


@dataclasses.dataclass(frozen=True)
class Traced:
    """What the traced functions close over (static for the life of a Trainer): what every kind
    of state shares. A kind -- two slots (TwoSlots) or one copy (OneCopy) -- adds its state's
    shapes and accessors (``slots``, ``tensors``, ``with_tensors``, ``state_specs``), its
    step, its repairs from the device's own redundancy, its scrub and its restore."""

    loss_fn: Callable[[Any, Any], jax.Array]
    opt: AdamW
    treedef: Any
    layout: StateLayout
    placement: Placement
    fault_capacity: int
    inject_gradients: bool
    inject_local: bool  # the hook also before the reduction (a fault on one device's gradients)
    transport: Transport  # how a chunk comes from another replica
    # -- the state ----------------------------------------------------------------------------

    device_copy = False  # a third copy of the state on each device (TwoSlots only)
    # Steps between scheduled scrubs when the Trainer is not told: what the steps leave unchecked.
    default_scrub_every = 10

    @property
    def local_source(self) -> bool:
        """Whether each device holds its own redundancy (a device copy, or parity)."""
        raise NotImplementedError

    def fresh(self, opt: Any) -> TrainState:
        """``opt`` (on the devices) as a run's state: not halted, nothing pending."""
        p, pending = self.placement, self.no_pending()
        if pending is not None:
            pending = jax.tree.map(lambda x, spec: p.put(x, p.sharding(spec)), pending,
                                   self.state_specs().pending)
        return TrainState(opt, p.put(np.int32(0)), pending)

    def repaired(self, opt: Any, leaves: list[dict]) -> Any:
        """``opt`` with its current tensors replaced by repaired ones."""
        return self.with_tensors(opt, leaves)

    def tensors(self, opt: Any) -> list[dict[str, tuple[jax.Array, jax.Array]]]:
        """The current state's tensors and digest tables, per leaf by tensor name."""
        raise NotImplementedError

    def scheduled_scrub(self, state: TrainState) -> Any:
        """The scrub the loop runs every ``scrub_every`` steps (and on a suspect device)."""
        return self.scrub(state)

    def with_tensors(self, opt: Any, leaves: list[dict]) -> Any:
        """``opt`` with its current tensors replaced (as they are: fault injection)."""
        raise NotImplementedError

    def _rebuilt(self, opt: Any, leaves: list[dict], take: jax.Array) -> Any:
        """``opt`` with the tensors a rebuild pulled (where ``take``; elsewhere as they were)."""
        raise NotImplementedError

    # -- shapes and shardings --------------------------------------------------------------------

    @property
    def leaf_specs(self) -> list[P]:
        return [P("shard") if sh else P() for sh in self.layout.sharded]

    @property
    def param_specs(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaf_specs)

    # -- the gradients -----------------------------------------------------------------------------

    def _reduced_and_gated(self, local: Any, grad_fault: jax.Array, opt: Any,
                           gate: jax.Array) -> tuple[Any, jax.Array, list[jax.Array]]:
        """The gradients summed over devices (with the campaign's fault, where it is meant for
        every replica), the gate closed where the replicas' states disagree, and their maps."""
        grads = self._reduce(local)
        if self.inject_gradients:  # what every replica then sees (grad_fault[1] == -1)
            grads = self._hook(grads, grad_fault, grad_fault[1] < 0)
        disagree = self._disagreement(opt)
        if disagree:  # the replicas' states differ: nothing commits until they agree again
            count = sum(jnp.sum(m != 0, dtype=jnp.int32) for m in disagree)
            gate &= jax.lax.psum(count, AXES) == 0
        return grads, gate, disagree

    def _ring(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """ppermute's pairs for a re-execution: device i gets device i + 1's slice of the
        batch (ahead), and the digests go back the other way."""
        n = len(self.placement.devices)
        ahead = [((i + 1) % n, i) for i in range(n)]
        return ahead, [(b, a) for a, b in ahead]

    def _recomputed_mismatches(self, params: Any, batch: dict, own: jax.Array) -> jax.Array:
        """Each device computes the next device's slice of the batch again from ``params``; the
        digests go back to the slice's device and are compared with ``own`` (its leaves' and
        its loss's digests, uint32 (leaves + 1, 2)). This device's count of those that differ."""
        ahead, back = self._ring()
        theirs = jax.tree.map(lambda x: jax.lax.ppermute(x, AXES, ahead), batch)
        grads, loss, _ = self._local_gradients(params, theirs, None)
        again = jax.lax.ppermute(self._digests(grads, loss), AXES, back)
        return jnp.sum(jnp.any(again != own, axis=-1), dtype=jnp.int32)

    def _gradients_twice(self, params: Any, batch: dict, grad_fault: jax.Array
                         ) -> tuple[Any, jax.Array, Any, jax.Array]:
        """A sampled step's gradients and their re-execution, both by one compiled loop body:
        this device's slice of the batch, then the next device's. Two copies of the gradient
        computation in one program may be compiled differently (fused otherwise, reduced in
        another order) and then differ in their last bits with nothing wrong; one body run
        twice executes the same kernels in the same order. The trip count passes an
        optimization barrier, so that the compiler cannot unroll the loop into two copies.
        Returns this device's gradients (with the campaign's fault where it is meant for
        it), its loss and aux, and this device's count of digests its re-execution did not
        reproduce."""
        ahead, back = self._ring()
        theirs = jax.tree.map(lambda x: jax.lax.ppermute(x, AXES, ahead), batch)
        both = jax.tree.map(lambda a, b: jnp.stack([a, b]), batch, theirs)

        def once(i):
            return self._local_gradients(params, jax.tree.map(lambda x: x[i], both), None)

        def body(i, out):
            return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, i, 0),
                                out, once(i))

        shapes = jax.eval_shape(once, 0)
        out = jax.tree.map(lambda s: jnp.zeros((2, *s.shape), s.dtype), shapes)
        trips = jax.lax.optimization_barrier(jnp.int32(2))
        out = jax.lax.fori_loop(0, trips, body, out)
        (grads, loss, aux), (again, loss_again, _) = (
            jax.tree.map(lambda x: x[k], out) for k in (0, 1))
        if self.inject_local:
            grads = self._hook(grads, grad_fault, grad_fault[1] == jax.lax.axis_index(AXES))
        returned = jax.lax.ppermute(self._digests(again, loss_again), AXES, back)
        mismatched = jnp.sum(jnp.any(returned != self._digests(grads, loss), axis=-1),
                             dtype=jnp.int32)
        return grads, loss, aux, mismatched

    def _hook(self, grads: Any, grad_fault: jax.Array, here: jax.Array) -> Any:
        """The campaign's gradient fault (pimhbm.faults.GradientFault, encoded) where ``here``."""
        leaves = self.treedef.flatten_up_to(grads)
        chosen = (jnp.arange(len(leaves))[:, None] == grad_fault[0]) & here
        spec = jnp.where(chosen, grad_fault[2:], jnp.zeros((8,), jnp.int32))
        return jax.tree.unflatten(self.treedef, [
            faults.inject_in_graph(g, spec[i]) for i, g in enumerate(leaves)])

    def _digests(self, grads: Any, loss: jax.Array) -> jax.Array:
        """uint32 (leaves + 1, 2): one digest of each whole gradient leaf (pimhbm.scan), and the
        loss's bits. The loss is compared too, not only for its own sake: a copy of the gradient
        computation whose loss is dead is compiled otherwise by XLA, and its gradients then differed
        in their last bits from the step's own (a tiny Llama on a CPU, bench/NOTES.md run 76)."""
        rows = [jnp.stack([jax.lax.bitcast_convert_type(loss.astype(jnp.float32), jnp.uint32),
                           jnp.uint32(0)])]
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
        leaves = self.tensors(opt)
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
        def scaled(p):
            loss, aux = self.loss_fn(p, batch)
            return loss / n, aux

        (loss, aux), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        if self.inject_local and grad_fault is not None:
            grads = self._hook(grads, grad_fault, grad_fault[1] == jax.lax.axis_index(AXES))
        return grads, loss, aux

    def _reported(self, loss: jax.Array, aux: Any) -> tuple[jax.Array, Any]:
        """What a step hands back besides its state: the whole batch's mean loss and the loss's
        aux -- its floating leaves averaged over devices, its integer ones (counts) summed."""
        over = lambda a: (jax.lax.pmean(a, AXES) if jnp.issubdtype(a.dtype, jnp.floating)
                          else jax.lax.psum(a, AXES))
        return jax.lax.psum(loss, AXES), jax.tree.map(over, aux)

    def _reduce(self, grads: Any) -> Any:
        """The sum over devices (the whole batch's mean: the loss was scaled); with FSDP the
        sharded leaves' sums reduce-scattered back to their shards. One device: the gradients
        as they are (a sum of one; an all-reduce of every leaf together, if the compiler kept
        it, would make each leaf's gradient wait for all of them)."""
        if len(self.placement.devices) == 1:
            return grads
        if self.layout.shard == 1:
            return jax.lax.psum(grads, "dp")
        return jax.tree.unflatten(self.treedef, [
            jax.lax.psum(jax.lax.psum_scatter(g, "shard", scatter_dimension=0, tiled=True)
                         if sh else jax.lax.psum(g, "shard"), "dp")
            for g, sh in zip(self.treedef.flatten_up_to(grads), self.layout.sharded)])

    # -- repairs -----------------------------------------------------------------------------------

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
        for i, leaf in enumerate(self.tensors(opt)):
            out = {}
            for j, k in enumerate(self.layout.names):
                cb = self.layout.chunk_bytes(k, i)
                if self.transport.in_programs is Transport.PEER:
                    out[k], status = pimhbm.peer.pull(
                        lists[i, j], src[i, j], leaf[k], cb, "dp", self.placement.mesh,
                        after=statuses[-1] if statuses else None)
                else:
                    out[k], status = replica.pull_collective(lists[i, j], src[i, j], leaf[k],
                                                             cb, "dp")
                statuses.append(status)
            new.append(out)
        return state._replace(opt=self.repaired(opt, new)), self.placement.per_device(
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
        for i, leaf in enumerate(self.tensors(opt)):
            out = {}
            for k in self.layout.names:
                (t, table), cb = leaf[k], self.layout.chunk_bytes(k, i)
                if self.transport.in_programs is Transport.PEER:
                    n = table.shape[0]
                    chunks = jnp.where(take, jnp.arange(n, dtype=jnp.int32), -1)
                    (t, table), after = pimhbm.peer.pull(
                        chunks, jnp.full((n,), source, jnp.int32), (t, table), cb, "dp",
                        self.placement.mesh, after=after)
                    bad += jnp.sum(take & (after != pimhbm.REPAIRED), dtype=jnp.int32)
                else:
                    t, table = (replica.copy_whole(x, source, take, "dp") for x in (t, table))
                    bad += jnp.sum(pimhbm.verify(t, table, cb), dtype=jnp.int32)
                out[k] = (t, table)
            new.append(out)
        return (state._replace(opt=self._rebuilt(opt, new, take)),
                self.placement.per_device(bad))

    def vote(self, state: TrainState, lists: jax.Array) -> jax.Array:
        """Where the replicas disagree, which of them holds the majority's chunk. lists: int32
        (shard, leaves, tensors, capacity), a row per shard column, -1 = none. Per device and
        listed chunk: Vote.MAJORITY (its digest is that of more than half the replicas),
        Vote.MINORITY, or Vote.NONE (no digest is held by more than half)."""
        lists, replicas = lists[0], self.placement.replicas
        opt, votes = state.opt, []
        for i, leaf in enumerate(self.tensors(opt)):
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

    # -- checks, snapshots, injection --------------------------------------------------------------

    def snapshot(self, opt: Any, *, backup: Any, slot: int, part: int) -> jax.Array:
        """Runs on this process's writer of shard column ``part``: it writes its shard of every
        sharded tensor (and, the first writer only, the replicated ones) to its place in the
        region (one writer per byte)."""
        offsets = iter(backup.offsets(slot))
        first = part == min(self.placement.writers)
        tensors, where = [], []
        for leaf, sharded in zip(self.tensors(opt), self.layout.sharded):
            for k in self.layout.names:
                for x in leaf[k]:
                    offset = next(offsets)
                    if sharded or first:
                        tensors.append(x)
                        where.append(offset + (part * x.size * x.dtype.itemsize if sharded else 0))
        return pimhbm.backup_snapshot(tensors, backup.region, where)

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


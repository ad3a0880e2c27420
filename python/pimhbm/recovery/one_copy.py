"""The engine's traced functions for one copy of the state (pimhbm.inplace): the step updates
the state in place, a chunk it finds damaged is left for a redo (rebuilt from its parity group,
then updated from the step's stash), and the repairs rebuild from the parity instead of a device
copy. Everything else -- gradients, replicas, the vote, snapshots, injection -- is Traced's.

The step may be cancelled only by what is known before its first write (pimhbm.inplace), so a
sampled step's re-execution runs inside the step, before the update, and closes its gate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pimhbm import parity
from pimhbm.inplace import AdamWState, GradientChecks, LeftChunks, Stash
from pimhbm.repair import NOT_LISTED, REPAIRED, STILL_DAMAGED, snapshot_fence
from pimhbm.scan import verify
from pimhbm.recovery.layout import Damage
from pimhbm.recovery.placement import AXES
from pimhbm.recovery.summary import ScrubSummary, inplace_summary, scrub_summary
from pimhbm.recovery.traced import HALTED, Traced, TrainState


@dataclasses.dataclass(frozen=True)
class OneCopy(Traced):
    """Traced for pimhbm.inplace.AdamW: one key for every program (no slot to flip)."""

    slots = (0,)
    recheck_in_step = True  # the re-execution runs before the update and closes its gate
    # Each step verifies every chunk's digests, and each committing update writes every parity
    # row anew from its group (a damaged row is whole again one step later): a scheduled scrub
    # would find nothing a repair needs.
    default_scrub_every = 0

    def after_step(self, current: int) -> int:
        return 0

    @property
    def has_parity(self) -> bool:
        return self.opt.group > 0

    @property
    def local_source(self) -> bool:
        return self.has_parity

    def tensors(self, opt: AdamWState) -> list[dict[str, tuple[jax.Array, jax.Array]]]:
        flat = self.treedef.flatten_up_to
        parts = {"p": flat(opt.params), "mu": flat(opt.mu), "nu": flat(opt.nu)}
        if opt.master is not None:
            parts["master"] = flat(opt.master)
        tables = flat(opt.digests)
        return [{k: (parts[k][i], tables[i][k]) for k in self.layout.names}
                for i in range(len(tables))]

    def with_tensors(self, opt: AdamWState, leaves: list[dict]) -> AdamWState:
        unflat = lambda f: jax.tree.unflatten(self.treedef, [f(leaf) for leaf in leaves])
        master = unflat(lambda l: l["master"][0]) if "master" in self.layout.names else None
        return opt._replace(params=unflat(lambda l: l["p"][0]), master=master,
                            mu=unflat(lambda l: l["mu"][0]), nu=unflat(lambda l: l["nu"][0]),
                            digests=unflat(lambda l: {k: l[k][1] for k in self.layout.names}))

    def repaired(self, opt: AdamWState, leaves: list[dict]) -> AdamWState:
        """Chunks that came from elsewhere (a replica) change their groups: the parity anew."""
        return self._with_parity(self.with_tensors(opt, leaves))

    def _rebuilt(self, opt: AdamWState, leaves: list[dict], take: jax.Array) -> AdamWState:
        return self.repaired(opt, leaves)

    def _with_parity(self, opt: AdamWState) -> AdamWState:
        if not self.has_parity:
            return opt
        rows = [{k: parity.parity(x, self.layout.chunk_bytes(k, i), self.opt.group)
                 for k, (x, _) in leaf.items()} for i, leaf in enumerate(self.tensors(opt))]
        return opt._replace(parity=jax.tree.unflatten(self.treedef, rows))

    # -- shapes and shardings --------------------------------------------------------------------

    def state_specs(self, current: int = 0) -> TrainState:
        ps = self.param_specs
        tables = jax.tree.map(lambda spec: {k: spec for k in self.layout.names}, ps,
                              is_leaf=lambda x: isinstance(x, P))
        opt = AdamWState(ps, ps if self.opt.master_weights else None, ps, ps, tables,
                         tables if self.has_parity else None, P())
        each = P(AXES)  # every device its own rows
        return TrainState(opt, P(), LeftChunks(Stash(each, each), each, P()))

    def pending_shapes(self) -> LeftChunks:
        """The global shapes of the pending redo (every device's rows stacked)."""
        n, cap = len(self.placement.devices), self.opt.stash_capacity
        sds = jax.ShapeDtypeStruct
        return LeftChunks(Stash(sds((n * cap, self.opt.chunk_elems), jnp.uint32),
                                sds((n * cap, 3), jnp.int32)),
                          sds((n,), jnp.int32), sds((3,), jnp.float32))

    def no_pending(self) -> LeftChunks:
        """Nothing left to redo (host arrays of pending_shapes)."""
        s = self.pending_shapes()
        index = np.tile(np.array([-1, -1, 0], np.int32), (s.stash.index.shape[0], 1))
        return LeftChunks(Stash(np.zeros(s.stash.rows.shape, np.uint32), index),
                          np.zeros(s.stashed.shape, np.int32), np.zeros((3,), np.float32))

    # -- the step ----------------------------------------------------------------------------------

    def step(self, state: TrainState, batch: dict, lr: jax.Array, grad_fault: jax.Array, *,
             digests: bool = False):
        """As Traced.step, in place; a sampled step (``digests``) also computes each device's
        slice again on the next device first (Traced._gradients_twice), and differing
        gradients close the gate, as a non-finite loss does where the update checks the
        gradients itself (``_nonfinite_loss``). The update waits for a snapshot copy still
        reading the state (snapshot_fence) before it writes."""
        mismatched = None
        gate = state.halted == 0
        if digests:
            local, loss, aux, mismatched = self._gradients_twice(state.opt.params, batch,
                                                                 grad_fault)
            gate &= jax.lax.psum(mismatched, AXES) == 0
        else:
            local, loss, aux = self._local_gradients(state.opt.params, batch, grad_fault)
        loss_nonfinite = self._nonfinite_loss(loss)
        gate &= loss_nonfinite == 0
        grads, gate, disagree = self._reduced_and_gated(local, grad_fault, state.opt, gate)
        lr = None if callable(self.opt.learning_rate) else lr
        # The checks only read the state: the fence (a snapshot copy may still be reading it)
        # comes after them, right before the update's writes.
        opt, report = self.opt.update(grads, state.opt, lr, gate=gate, axis_name=AXES,
                                      before_writes=snapshot_fence)
        summary = inplace_summary(report, self.treedef, self.fault_capacity, disagree,
                                  loss_nonfinite)
        halted = state.halted | jnp.where(summary.committed != 0, 0, HALTED)
        # A step that did not run (halted behind one that left chunks) keeps that one's.
        left = report.left
        pending = jax.tree.map(lambda new, old: jnp.where(report.applied, new, old),
                               LeftChunks(left.stash, left.stashed[None], left.scalars),
                               state.pending)
        out = (TrainState(opt, halted, pending), self._reported(loss, aux),
               self.placement.per_device(summary))
        return out if mismatched is None else (*out, self.placement.per_device(mismatched))

    def _nonfinite_loss(self, loss: jax.Array) -> jax.Array:
        """int32: 1 where this device's loss is not finite and the update checks the gradients
        itself (GradientChecks.IN_UPDATE), which finds non-finite ones only as it writes -- a
        host restore each. A non-finite loss, the usual way they come (a diverging run, a bad
        batch), then holds the step before any write: a skip. 0 where the checks before the
        writes read the gradients (the loss adds nothing there)."""
        if self.opt.gradient_checks is not GradientChecks.IN_UPDATE:
            return jnp.int32(0)
        return (~jnp.isfinite(loss)).astype(jnp.int32)

    def redo(self, state: TrainState) -> tuple[TrainState, jax.Array]:
        """The chunks the last step left, rebuilt from their parity and updated from the stash
        (pimhbm.inplace.AdamW.repair). Per device: (complete, redone chunks still damaged)."""
        pending = state.pending
        left = LeftChunks(pending.stash, pending.stashed[0], pending.scalars)
        opt, report = self.opt.repair(state.opt, left)
        return state._replace(opt=opt), self.placement.per_device(
            jnp.stack([report.complete.astype(jnp.int32), report.faults]))

    # -- repairs -----------------------------------------------------------------------------------

    def repair(self, state: TrainState, lists: jax.Array, *, into_copy: bool):
        """Listed chunks (int32 (leaves, tensors, capacity)) rebuilt in place from their parity
        groups -- or, ``into_copy``, the parity made anew from the state where a scrub found
        rows that no longer match their groups (a listed chunk: REPAIRED where its group's row
        was remade, STILL_DAMAGED where a chunk of the group is damaged and the row kept)."""
        if into_copy:
            opt, remade = self._remade_parity(state.opt)
            status = [jnp.zeros(c.shape, jnp.int32) if r.shape[0] == 0 else
                      jnp.where((c >= 0) & jnp.take(r, jnp.take(groups, c, mode="clip"),
                                                    mode="clip"),
                                REPAIRED, jnp.where(c >= 0, STILL_DAMAGED, NOT_LISTED))
                      for (r, groups), c in zip(remade, lists.reshape(-1, lists.shape[-1]))]
            return state._replace(opt=opt), self.placement.per_device(
                jnp.stack(status).reshape(lists.shape).astype(jnp.int32))
        opt = state.opt
        rows = self.treedef.flatten_up_to(opt.parity)
        statuses, new = [], []
        for i, leaf in enumerate(self.tensors(opt)):
            out = {}
            for j, k in enumerate(self.layout.names):
                x, table = leaf[k]
                x, status = parity.rebuild(lists[i, j], x, table, rows[i][k],
                                           self.layout.chunk_bytes(k, i), self.opt.group)
                out[k] = (x, table)
                statuses.append(status)
            new.append(out)
        return state._replace(opt=self.with_tensors(opt, new)), self.placement.per_device(
            jnp.stack(statuses).reshape(lists.shape))

    # -- checks, snapshots ---------------------------------------------------------------------------

    def scrub(self, state: TrainState) -> ScrubSummary:
        """Every chunk's digests (a restored snapshot, the end of a run), and every parity row
        against its group, as :meth:`scheduled_scrub`."""
        return self._scrub(state, digests=True)

    def scheduled_scrub(self, state: TrainState) -> ScrubSummary:
        """The scrub between steps: every parity row against its group -- the one thing no step
        checks (each step verifies every chunk's digests). A row that differs is marked on its
        group's chunks with the tensor's Damage bits shifted by 4 (the redundancy's)."""
        return self._scrub(state, digests=False)

    def _scrub(self, state: TrainState, *, digests: bool) -> ScrubSummary:
        opt = state.opt
        rows = self.treedef.flatten_up_to(opt.parity) if self.has_parity else None
        maps = []
        for i, leaf in enumerate(self.tensors(opt)):
            n = leaf["p"][1].shape[0]
            acc = jnp.zeros((n,), jnp.int32)
            for k in self.layout.names:
                (x, table), cb = leaf[k], self.layout.chunk_bytes(k, i)
                if digests:
                    acc |= verify(x, table, cb).astype(jnp.int32) * int(Damage.of(k))
                if rows is not None and n:
                    stale = self._stale_groups(x, rows[i][k], cb)
                    marks = stale[self._groups(n)]  # each chunk marked as its group
                    acc |= marks.astype(jnp.int32) * int(Damage.of(k, in_copy=True))
            maps.append(acc)
        return self.placement.per_device(scrub_summary(maps, self.fault_capacity))

    def _groups(self, chunks: int) -> jax.Array:
        """The parity group of each of a tensor's chunks (int32)."""
        return parity.chunk_groups(chunks, self.opt.group, xp=jnp)

    def _stale_groups(self, x: jax.Array, rows: jax.Array, chunk_bytes: int) -> jax.Array:
        """bool per group: its parity row is not the XOR of its chunks."""
        return jnp.any(parity.parity(x, chunk_bytes, self.opt.group) != rows, axis=1)

    def _remade_parity(self, opt: AdamWState
                       ) -> tuple[AdamWState, list[tuple[jax.Array, jax.Array]]]:
        """The parity made anew from the state, except in a group with a chunk that fails its
        digest (its row is what rebuilds that chunk: the next step will); per leaf and tensor,
        bool per group (remade) and the group of each chunk."""
        remade, rows, out = [], self.treedef.flatten_up_to(opt.parity), []
        for i, leaf in enumerate(self.tensors(opt)):
            new = {}
            for k, (x, table) in leaf.items():
                cb, old = self.layout.chunk_bytes(k, i), rows[i][k]
                bad, groups = verify(x, table, cb), self._groups(table.shape[0])
                damaged = jnp.zeros((old.shape[0],), jnp.int32).at[groups].max(
                    bad.astype(jnp.int32)) > 0
                new[k] = jnp.where(damaged[:, None], old, parity.parity(x, cb, self.opt.group))
                remade.append((~damaged, groups))
            out.append(new)
        return opt._replace(parity=jax.tree.unflatten(self.treedef, out)), remade

    def clone(self, opt: AdamWState) -> AdamWState:
        """A state put back from a snapshot (tensors and digests) made whole: its parity."""
        return self._with_parity(opt)

    def restored(self, leaves: list[dict], step: int, put: Any, clone: Any) -> AdamWState:
        """The state from a snapshot's tensors (on the devices): ``clone`` (the compiled
        :meth:`clone`) adds the parity."""
        empty = AdamWState(None, None, None, None, None, None, put(np.full(3, step, np.int32)))
        return clone(self.with_tensors(empty, leaves))

"""The engine's traced functions for two slots of the state (pimhbm.update.adamw): the step writes
the other slot, a sampled step's re-execution runs after it and can undo it, and the repairs
rewrite damaged chunks from the device copy (or rewrite the device copy from the state).
Everything else -- gradients, replicas, the vote, snapshots, injection -- is Traced's."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pimhbm
from pimhbm.recovery.layout import Damage
from pimhbm.recovery.placement import AXES
from pimhbm.recovery.summary import ScrubSummary, scrub_summary, step_summary
from pimhbm.recovery.traced import HALTED, Traced, TrainState
from pimhbm.update import (AdamWState, Slot, restore_unless, slot_from_tensors, slot_tensors,
                           step_copies_of)


def _with_copy(opt: AdamWState, device_copy: Slot | None) -> AdamWState:
    return AdamWState(opt.slots, opt.current, opt.step_copies, device_copy)


def _copy_of_rebuilt(slot: Slot, device_copy: Slot | None, take: jax.Array) -> Slot | None:
    """The device copy of a rebuilt device: the same as its new current slot (after a commit the
    copy equals the state; nothing committed since); elsewhere unchanged."""
    if device_copy is None:
        return None
    return jax.tree.map(lambda n, m: jnp.where(take, n, m), slot, device_copy)


@dataclasses.dataclass(frozen=True)
class TwoSlots(Traced):
    """Traced for pimhbm.update.AdamW: programs keyed by the parity of the slot they read."""

    slots = (0, 1)  # the programs' keys: the parity of the slot their input state reads
    recheck_in_step = False  # a sampled step is undone by the re-execution after it

    @property
    def device_copy(self) -> bool:
        return self.opt.device_copy

    @property
    def local_source(self) -> bool:
        """Whether each device holds its own redundancy (a device copy; OneCopy: parity)."""
        return self.device_copy

    def after_step(self, current: int) -> int:
        """The key of the state a step leaves (it writes the other slot)."""
        return 1 - current

    def tensors(self, opt: Any) -> list[dict[str, tuple[jax.Array, jax.Array]]]:
        """The current state's tensors and digest tables, per leaf by tensor name."""
        return slot_tensors(opt.slots[opt.current], self.treedef)

    def with_tensors(self, opt: Any, leaves: list[dict]) -> Any:
        """``opt`` with its current tensors replaced (as they are: fault injection)."""
        return opt.replace_current(slot_from_tensors(leaves, self.treedef))

    def slot_specs(self) -> Slot:
        """The PartitionSpecs of a Slot: each tensor and digest table as its parameter."""
        ps = self.param_specs
        tables = jax.tree.map(lambda spec: {k: spec for k in self.layout.names}, ps,
                              is_leaf=lambda x: isinstance(x, P))
        return Slot(ps, ps if self.opt.master_weights else None, ps, ps, tables)

    def state_specs(self, current: int = 0) -> TrainState:
        slot = self.slot_specs()
        copy = slot if self.opt.device_copy else None
        return TrainState(AdamWState((slot, slot), current, P(), copy), P(), None)

    def step(self, state: TrainState, batch: dict, lr: jax.Array, grad_fault: jax.Array, *,
             digests: bool = False):
        """Gradients of this device's slice of the batch, their mean over devices, the guarded
        update with a global verdict; the loss and this device's summary -- and, ``digests``
        (a sampled step), the digests of this device's own gradients before the reduction,
        for :meth:`recheck` to compare with."""
        local, loss, aux = self._local_gradients(state.opt.params, batch, grad_fault)
        own = self._digests(local, loss)[None] if digests else None
        grads, gate, disagree = self._reduced_and_gated(local, grad_fault, state.opt,
                                                        state.halted == 0)
        lr = None if callable(self.opt.learning_rate) else lr
        opt, report = self.opt.update(grads, state.opt, lr, gate=gate, axis_name=AXES)
        halted = state.halted | jnp.where(report.committed, 0, HALTED)
        summary = step_summary(report, self.treedef, self.fault_capacity, disagree)
        out = TrainState(opt, halted), self._reported(loss, aux), self.placement.per_device(summary)
        return out if own is None else (*out, own)

    def recheck(self, state: TrainState, batch: dict, committed: jax.Array,
                digests: jax.Array) -> tuple[TrainState, jax.Array]:
        """A sampled step computed again: each device recomputes the gradients of the next
        device's slice of the batch (its own, alone) from the parameters the step read (the
        other slot), and their digests go back to the slice's device to be compared with the
        step's (``digests``). Where any differs the step is undone -- the state the step read
        copied back into the current slot and the device copy, the step count put back, the
        halt flag set -- and the slice's device reports it. Returns the state and, per device,
        the gradient leaves whose digests differ."""
        opt = state.opt
        mismatched = self._recomputed_mismatches(opt.slots[1 - opt.current].params, batch,
                                                 digests[0])
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

    def _rebuilt(self, opt: Any, leaves: list[dict], take: jax.Array) -> Any:
        """``opt`` with the tensors a rebuild pulled (where ``take``; elsewhere as they were) --
        and the device copy, where taken, the same as them."""
        slot = slot_from_tensors(leaves, self.treedef)
        opt = _with_copy(opt, _copy_of_rebuilt(slot, opt.device_copy, take))
        return opt.replace_current(slot)

    def recopy(self, state: TrainState, targets: jax.Array) -> TrainState:
        """The device copy of the ``targets`` devices (int32 (dp, shard), 1 = yes) made anew
        from their current slot (after a whole state was pulled into it over CUDA IPC)."""
        opt, take = state.opt, targets[0, 0] != 0
        copy = _copy_of_rebuilt(opt.slots[opt.current], opt.device_copy, take)
        return TrainState(_with_copy(opt, copy), state.halted)

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
        return self.placement.per_device(scrub_summary(maps, self.fault_capacity))

    def clone(self, slot: Slot) -> tuple[Slot, Slot | None]:
        """Two more copies of a slot: the other slot, and the device copy (if any)."""
        return (jax.tree.map(jnp.copy, slot),
                jax.tree.map(jnp.copy, slot) if self.opt.device_copy else None)

    def restored(self, leaves: list[dict], step: int, put: Any, clone: Any) -> AdamWState:
        """The state from a snapshot's tensors (on the devices): the other slot and the device
        copy made from them there by ``clone`` (the compiled :meth:`clone`)."""
        first = slot_from_tensors(leaves, self.treedef)
        other, copy = clone(first)
        return AdamWState((first, other), 0, put(np.full(3, step, np.int32)), copy)

    def pending_shapes(self) -> None:
        return None  # two slots: a step leaves nothing to redo

    def no_pending(self) -> None:
        return None


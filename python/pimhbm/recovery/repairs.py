"""Damaged chunks rewritten in place, from the nearest intact copy the devices hold.

The sources, in order: each device's own device copy (chunk by chunk); a healthy replica of the
chunk on another device (without device copies: the first source); a device's whole state
rebuilt from a replica that saw no damage at all (when the damage was too much to list, or some
chunk had no intact copy). What none of them can repair goes to the host snapshot (the
Trainer's), as does everything after a replica transfer that failed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

import pimhbm
from pimhbm.recovery.events import Action, Incident, IncidentKind, RunStats
from pimhbm.recovery.layout import ChunkDamage, ChunkRef, Damage, StateLayout
from pimhbm.recovery.placement import Placement
from pimhbm.recovery.planner import (ReplicaPull, local_batches, local_work, plan_majority_pulls,
                                     plan_rebuild, plan_replica_pulls, pull_sources, vote_batches)
from pimhbm.recovery.programs import Programs
from pimhbm.recovery.summary import FaultReport
from pimhbm.recovery.traced import TrainState, slot_of
from pimhbm.recovery.transports import Pulled, ReplicaTransport, TransportFailed


class RepairOutcome(NamedTuple):
    action: Action | None  # None: some chunk has no intact copy on the devices
    sources: tuple[int, ...] = ()  # devices the chunks came from (replica repairs)
    snapshot_step: int | None = None  # RESTORED_FROM_SNAPSHOT: the snapshot's step

    @property
    def repaired(self) -> bool:
        return self.action is not None


_UNREPAIRED = RepairOutcome(None)
_NOTHING = RepairOutcome(Action.SKIPPED_AND_REPLAYED)  # nothing of that kind to repair


class Recovery(NamedTuple):
    """The repair of a fault report: of the chunks that failed their digest, of those the
    replicas disagree on, and the transport incidents met on the way."""

    damage: RepairOutcome
    disagreement: RepairOutcome
    notes: tuple[Incident, ...] = ()

    @property
    def repaired(self) -> bool:
        return self.damage.repaired and self.disagreement.repaired

    def incidents(self, report: FaultReport) -> list[Incident]:
        """One incident per kind per step that saw it (damage persists until repaired: a step
        halted behind the first one names it again), then what the transports met."""
        out = []
        for r in report.steps:
            if r.miscomputed:
                out.append(Incident(r.step, IncidentKind.COMPUTE, (), Action.SKIPPED_AND_REPLAYED,
                                    devices=r.miscomputed, detail="gradients computed again on "
                                    "the next device differ: the step was undone"))
            for kind, locations, outcome in ((IncidentKind.STATE, r.state, self.damage),
                                             (IncidentKind.DISAGREEMENT, r.disagree,
                                              self.disagreement)):
                if locations:
                    out.append(Incident(r.step, kind, locations, outcome.action, outcome.sources,
                                        outcome.snapshot_step))
            if r.grads:
                out.append(Incident(r.step, IncidentKind.GRADIENT, r.grads,
                                    Action.SKIPPED_AND_REPLAYED, unlisted=r.grads_unlisted))
        return out + list(self.notes)

    @classmethod
    def nothing(cls) -> "Recovery":
        """Nothing to repair (the gradients alone: the step is replayed)."""
        return cls(_NOTHING, _NOTHING)

    def restored(self, step: int) -> "Recovery":
        """Everything from the host snapshot of ``step`` instead."""
        outcome = RepairOutcome(Action.RESTORED_FROM_SNAPSHOT, snapshot_step=step)
        return Recovery(outcome, outcome, self.notes)


class Repairer:
    """Runs the repair programs over the state (each donates it and returns the new one)."""

    def __init__(self, programs: Programs, placement: Placement, layout: StateLayout,
                 transport: ReplicaTransport, capacity: int, device_copy: bool,
                 local: Action | None):
        self.programs, self.placement, self.layout = programs, placement, layout
        self.transport, self.capacity, self.device_copy = transport, capacity, device_copy
        # What a device's own redundancy repairs with (the device copy, or parity), or None.
        self.local = local

    def recover(self, state: TrainState, report: FaultReport, stats: RunStats, *,
                local: bool = True) -> tuple[TrainState | None, Recovery]:
        """The state with every damaged chunk of ``report`` repaired, and how; the state is
        None when a replica transfer failed and took it (it was donated). ``local=False``:
        not from the devices' own redundancy (it was tried: the chunks need another source)."""
        notices: list[str] = []  # transports that changed on the way
        note = lambda action, detail: Incident(report.first_step, IncidentKind.TRANSPORT, (),
                                               action, detail=detail)
        damage, agreement, failed = _NOTHING, _NOTHING, []
        try:
            if report.state_damaged:
                state, damage = self._from_devices(state, report, stats, notices, local)
            if damage.repaired and report.disagree:
                state, agreement = self._from_majority(state, report, stats, notices)
        except TransportFailed as err:
            state, damage = None, _UNREPAIRED
            failed = [note(Action.HOST_SNAPSHOT_INSTEAD, str(err))]
        notes = [note(Action.COLLECTIVE_FROM_NOW_ON, n) for n in notices] + failed
        return state, Recovery(damage, agreement, tuple(notes))

    def _from_devices(self, state, report, stats, notes,
                      local: bool) -> tuple[TrainState, RepairOutcome]:
        outcome = _UNREPAIRED
        if not report.overflow and (self.local is None or not local):  # from another replica
            state, outcome = self._from_replicas(state, report.chunks, stats, notes)
        elif not report.overflow:
            entries = [ChunkDamage(0, i, d) for i, d in report.damage.items()]
            state, failures = self.rewrite(state, entries, stats, into_copy=False)
            # The device copy is damaged too (a double fault): another device's copy of the
            # state, current to the same step, before the host snapshot and a replay.
            if failures:
                state, outcome = self._from_replicas(state, failures, stats, notes)
            else:
                outcome = RepairOutcome(self.local)
        if not outcome.repaired:
            # Too much damage to list (a lost shard) or no intact copy of some chunk: the
            # whole state from a device that saw no damage at all.
            state, outcome = self._rebuild(state, report, stats, notes)
        return state, outcome

    def rewrite(self, state: TrainState, entries: list[ChunkDamage], stats: RunStats, *,
                into_copy: bool) -> tuple[TrainState, list[ChunkRef]]:
        """The chunks of ``entries`` rewritten from the device copy or rebuilt from parity
        (``into_copy``: the device copy, or the parity, made anew from the current state) on
        every device; the chunks that did not verify afterwards."""
        p, failures = self.placement, []
        work = local_work(entries, self.layout, in_copy=into_copy)
        for lists, _ in local_batches(work, self.layout, self.capacity):
            program = self.programs.repair[slot_of(state.opt), into_copy]
            state, status = program(state, p.put(lists))
            status = p.fetch(status)  # [devices, leaves, tensors, capacity]
            stats.repairs += int(np.sum(status[0] == pimhbm.REPAIRED))
            bad = (lists[None] >= 0) & (status != pimhbm.REPAIRED)
            for d, li, ti, r in zip(*np.nonzero(bad)):
                failures.append(ChunkRef(int(d), self.layout.paths[li], self.layout.names[ti],
                                         int(lists[li, ti, r])))
        return state, failures

    def _from_replicas(self, state, damaged: list[ChunkRef], stats,
                       notes) -> tuple[TrainState, RepairOutcome]:
        """Chunks pulled from a device whose copy of them is healthy."""
        if not self.programs.replica:
            return state, _UNREPAIRED
        pulls = plan_replica_pulls(damaged, self.layout, self.placement.replicas)
        if pulls is None:
            return state, _UNREPAIRED
        return self._pull(state, pulls, stats, notes)

    def _from_majority(self, state, report: FaultReport, stats,
                       notes) -> tuple[TrainState, RepairOutcome]:
        """The chunks the replicas disagree on, from a replica that holds the majority's: the
        vote program says which; without a majority (two replicas), nothing here."""
        if not self.programs.vote:
            return state, _UNREPAIRED
        p, pulls = self.placement, []
        for batch in vote_batches(report.disagree, self.layout, self.capacity):
            try:
                votes = p.fetch(self.programs.vote[slot_of(state.opt)](
                    state, p.put(batch.lists, p.by_column)))
            except jax.errors.JaxRuntimeError as err:
                raise TransportFailed(f"failed ({str(err).splitlines()[0][:200]})") from err
            planned = plan_majority_pulls(batch, votes, self.layout, p.replicas)
            if planned is None:
                return state, _UNREPAIRED
            pulls += planned
        if not pulls:  # they agree again (the digests' repair made them)
            return state, RepairOutcome(Action.REPAIRED_FROM_REPLICA)
        return self._pull(state, pulls, stats, notes)

    def _pull(self, state, pulls: list[ReplicaPull], stats,
              notes) -> tuple[TrainState, RepairOutcome]:
        """The pulls through the transport; then the device copy (if any) of those chunks
        rewritten from the repaired state."""
        state, verified = self._count(self.transport.pull(state, pulls), stats, notes)
        if not verified:
            return state, _UNREPAIRED
        if self.device_copy:
            base = self.layout.chunk_base
            entries = [ChunkDamage(0, int(base[self.layout.leaf_index(p.leaf)]) + p.chunk,
                                   Damage.of(p.tensor, in_copy=True)) for p in pulls]
            state, failures = self.rewrite(state, entries, stats, into_copy=True)
            if failures:
                return state, _UNREPAIRED
        stats.replica_repairs += len(pulls)
        return state, RepairOutcome(Action.REPAIRED_FROM_REPLICA, pull_sources(pulls, self.layout))

    def _rebuild(self, state, report: FaultReport, stats, notes) -> tuple[TrainState, RepairOutcome]:
        if not self.programs.rebuild:
            return state, _UNREPAIRED
        plan = plan_rebuild(report.damaged_devices, self.layout, self.placement.replicas)
        if plan is None:
            return state, _UNREPAIRED
        state, verified = self._count(self.transport.rebuild(state, plan), stats, notes)
        if not verified:
            return state, _UNREPAIRED
        stats.replica_rebuilds += int(plan.targets.sum())
        return state, RepairOutcome(Action.REBUILT_FROM_REPLICA, plan.source_devices(self.layout))

    @staticmethod
    def _count(pulled: Pulled, stats: RunStats, notes: list[str]) -> tuple[TrainState, bool]:
        stats.repairs += pulled.repairs
        stats.ipc_pulls += pulled.ipc_pulls
        if pulled.notice:
            notes.append(pulled.notice)
        return pulled.state, pulled.verified

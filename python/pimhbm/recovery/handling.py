"""What the Trainer does when a step's summary names damage: the steps halted behind it, the
repairs (pimhbm.recovery.repairs; the host snapshot when the devices hold no intact copy), a
one-copy step's redo, and what a scrub found. A part of the Trainer (a mixin of its methods:
they read and replace its state, statistics and programs)."""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from pimhbm import ipc
from pimhbm.recovery.events import SETTINGS_HINT, Action, Incident, IncidentKind, record
from pimhbm.recovery.layout import STATE_BITS, ChunkDamage, Damage
from pimhbm.recovery.repairs import Recovery
from pimhbm.recovery.summary import (FaultReport, StepReport, decode_scrub, decode_step, merge,
                                     scrub_overflowed, whole_chunks)
from pimhbm.recovery.traced import TrainState, slot_of


class InFlight(NamedTuple):
    """A dispatched step whose results the host has not read yet."""

    step: int
    loss: jax.Array
    summary: Any  # StepSummary of device arrays
    scrub: Any  # ScrubSummary of device arrays, or None
    recheck: Any = None  # a sampled step's re-execution: per device, leaves that differed


class FaultHandling:
    """The Trainer's handling of faults (see the module's docstring)."""

    def _halted_behind(self, flight: collections.deque, done: InFlight) -> list[StepReport]:
        """The steps dispatched after ``done``, halted (they skipped: halt flag); their summaries
        may name more damage (injected while they were in flight)."""
        self.stats.steps_skipped += len(flight)
        later = [decode_step(f.step, *self.placement.fetch((f.summary,)), self.layout,
                             self.placement.fetch(f.recheck)) for f in flight]
        jax.block_until_ready([done.scrub] + [f.scrub for f in flight])  # readers of the state
        flight.clear()
        self.snapshots.dropped()
        return later

    def _skip(self, report: StepReport, flight: collections.deque,
              done: InFlight) -> tuple[int, StepReport]:
        """A skipped step (or one applied in part), and those halted behind it. Returns the step
        to replay from, and the step's report as handled (a scrub's finds added)."""
        self.stats.steps_skipped += 1
        later = self._halted_behind(flight, done)
        if report.loss_nonfinite and not report.applied:
            report = self._held_by_its_loss(report)
        faults = merge([report] + later)
        replay_from = self._restore_torn(faults) if report.applied else self._handle_fault(faults)
        if report.bad_scalars:  # (the steps halted behind it drew theirs from the same count)
            record(self.stats, [Incident(report.step, IncidentKind.UPDATE, (),
                                         Action.SKIPPED_AND_REPLAYED, detail="its learning rate "
                                         "or bias corrections could not make finite values")])
        self.miscomputed.update(d for r in faults.steps for d in r.miscomputed)
        if twice := sorted(d for d, n in self.miscomputed.items() if n >= 2):
            raise self._failure(f"device {twice[0]} computed gradients that another device's "
                                "re-execution did not reproduce, twice: it computes wrongly",
                                twice[0])
        return replay_from, report

    def _held_by_its_loss(self, report: StepReport) -> StepReport:
        """A step whose non-finite loss held it before any write. With no checks before the
        writes (speculative), nothing has looked at the parameters the loss came from: the
        state is scrubbed now, and what that finds joins the report (repaired before the
        replay, as the checks would have had it). Where nothing else explains the step, the
        loss is recorded."""
        if getattr(self.opt, "speculative", False):
            report = self._with_scrubbed_state(report)
        if not (report.damaged or report.disagree or report.nonfinite or report.bad_scalars
                or report.overflow or report.grads or report.miscomputed):
            record(self.stats, [Incident(report.step, IncidentKind.LOSS, (),
                                         Action.SKIPPED_AND_REPLAYED, detail="its loss was not "
                                         "finite: the update applied nothing")])
        return report

    def _with_scrubbed_state(self, report: StepReport) -> StepReport:
        """``report`` with the damaged chunks of the current state a scrub finds (every
        chunk's digests), as if the step's summary had listed them; overflowed, its device
        damaged, where the scrub marked more chunks than its list holds (its parity marks count
        too): the repair then takes that device's state from another source."""
        scrub = self.placement.fetch(self.programs.scrub[slot_of(self.state.opt)](self.state))
        found = [ChunkDamage(e.device, e.index, Damage(int(e.damage) & STATE_BITS))
                 for e in decode_scrub(scrub) if e.damage.in_state]
        past = scrub_overflowed(scrub)
        devices = report.damaged_devices | past
        devices[[e.device for e in found]] = True
        report = report._replace(overflow=report.overflow or bool(past.any()),
                                 damaged_devices=devices)
        if not found:
            return report
        return report._replace(
            damaged=report.damaged + tuple(found), faulty=report.faulty + len(found),
            state=report.state + tuple(loc for e in found for loc in self.layout.locate(e)))

    def _left(self, report: StepReport, flight: collections.deque, done: InFlight,
              progress: Callable | None) -> int:
        """A step that ran but left damaged chunks unwritten (one copy), and the steps halted
        behind it: the chunks rebuilt from their parity groups and their update redone -- the
        step is then whole -- else taken from another source (a replica's chunk: it committed
        the step; or the host snapshot). Returns the step to go on from."""
        later = self._halted_behind(flight, done)
        if self._redo():
            record(self.stats, [Incident(report.step, IncidentKind.STATE, report.state,
                                         Action.REDONE_FROM_PARITY)])
            go_on = done.step + 1
            if any(r.damaged or r.disagree or r.overflow for r in later):
                go_on = self._handle_fault(merge(later))
            else:
                self.state = self.state._replace(halted=self.placement.put(np.int32(0)))
        else:
            go_on = self._handle_fault(merge([whole_chunks(report, self.layout)] + later),
                                       local=False, resume_at=done.step + 1)
        if go_on > done.step:
            self._commit(done, progress)
        return go_on

    def _redo(self) -> bool:
        """The redo of the chunks the last step left (parity, then the stash): whether every
        device finished it (no parity: nothing to redo with)."""
        program = self.programs.redo.get(slot_of(self.state.opt))
        if program is None:
            return False
        self.state, outcome = program(self.state)
        outcome = self.placement.fetch(outcome)  # per device: (complete, still damaged)
        complete = bool(np.all(outcome[:, 0] == 1))
        if complete:
            self.stats.repairs += 1
        return complete

    # -- handling faults ------------------------------------------------------------------------

    def _handle_fault(self, report: FaultReport, *, local: bool = True,
                      resume_at: int | None = None) -> int:
        """Repairs after the skipped steps; returns the step to resume from (``resume_at``
        where the repair puts the state back as it was after them: the first of them
        otherwise). ``local=False``: not from the devices' own redundancy."""
        recovery = Recovery.nothing()
        if report.state_damaged or report.disagree:
            try:
                state, recovery = self.repairer.recover(self.state, report, self.stats,
                                                        local=local)
            except ipc.Fatal as err:  # a pull may still be writing the state: stop here
                raise self._failure(str(err)) from err
            if recovery.repaired:
                self.state = state
            else:
                self.state, snap = self._restore_from_host()
                recovery = recovery.restored(snap)
        record(self.stats, recovery.incidents(report))
        if recovery.damage.snapshot_step is not None:
            return recovery.damage.snapshot_step + 1
        self.state = self.state._replace(halted=self.placement.put(np.int32(0)))
        return report.first_step if resume_at is None else resume_at

    def _suspect(self, report: StepReport) -> bool:
        """Whether a step the update applied found a damaged parameter chunk with no checks
        before its writes (pimhbm.inplace.ParameterChecks.IN_UPDATE; the update's count over
        every device, listed or not): the damage may have made the step's gradients, so the
        chunk's redo would not make the step whole."""
        return report.suspect

    def _restore_torn(self, faults: FaultReport) -> int:
        """A step the update applied in part: it kept the elements whose new values were not
        finite -- from non-finite gradient values where it checks them itself
        (pimhbm.inplace.GradientChecks.IN_UPDATE), or from its own arithmetic -- and wrote the
        rest, so the state is neither the step's nor the one before it; or, with no checks
        before its writes, it found a damaged parameter chunk (``_suspect``). The host
        snapshot, then a replay from it, which executes the step again; what it and the steps
        halted behind it found is recorded as restored. Returns the step to replay from."""
        if self.backup is None or not self.snapshots.every:
            torn = faults.steps[0]
            what = (f"kept {torn.kept} elements whose new values were not finite" if torn.kept
                    else "found a damaged parameter chunk its gradients may have read")
            raise RuntimeError(
                f"step {torn.step}'s update {what} and wrote the rest, so the state on the "
                "devices is neither that step's nor the one before (do not save it). Only a "
                "recent host snapshot takes it back: pass shm_name= and snapshot_every > 0. " +
                SETTINGS_HINT + ".")
        self.state, snap = self._restore_from_host()
        found = []
        for r in faults.steps:
            for kind, where in ((IncidentKind.STATE, r.state),
                                (IncidentKind.DISAGREEMENT, r.disagree),
                                (IncidentKind.GRADIENT, r.grads)):
                if where:
                    found.append(Incident(r.step, kind, where, Action.RESTORED_FROM_SNAPSHOT,
                                          snapshot_step=snap, unlisted=kind is
                                          IncidentKind.GRADIENT and r.grads_unlisted))
            if r.kept and not r.grads:  # the update's own arithmetic (the gradients were finite)
                found.append(Incident(r.step, IncidentKind.UPDATE, (),
                                      Action.RESTORED_FROM_SNAPSHOT, snapshot_step=snap,
                                      detail=f"{r.kept} elements kept"))
        record(self.stats, found)
        return snap + 1

    def _restore_from_host(self) -> tuple[TrainState, int]:
        if self.backup is None:
            raise RuntimeError("the device copy is damaged too and there is no host snapshot "
                               "(pass shm_name= to keep one)")
        state, step = self.snapshots.restore(self.treedef)
        self.stats.host_restores += 1
        return state, step

    def _handle_scrub(self, step: int, scrub: Any) -> None:
        """The device copy's damaged chunks rewritten from the current state (the state's own
        damage is the next step's to find)."""
        self.stats.scrubs += 1
        entries = [e for e in decode_scrub(scrub) if e.damage.in_copy]
        if not entries:
            return
        locs = tuple(loc for e in entries for loc in self.layout.locate(e, in_copy=True))
        self.state, failures = self.repairer.rewrite(self.state, entries, self.stats,
                                                     into_copy=True)
        if self.one_copy:  # parity rows out of step with their groups: made anew, but where
            # a chunk of the group is damaged (the row rebuilds it: the next step does)
            record(self.stats, [Incident(step, IncidentKind.PARITY, locs, Action.PARITY_KEPT
                                         if failures else Action.PARITY_REMADE)])
            return
        record(self.stats, [Incident(
            step, IncidentKind.DEVICE_COPY, locs,
            Action.DEVICE_COPY_NOT_REPAIRED if failures else Action.DEVICE_COPY_REPAIRED)])

    def _current_slot_verifies(self) -> bool:
        """A scrub of the current state: whether every chunk of the current slot verifies."""
        scrub = self.placement.fetch(self.programs.scrub[slot_of(self.state.opt)](self.state))
        return not any(e.damage.in_state for e in decode_scrub(scrub))

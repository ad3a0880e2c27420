"""The Trainer's run loop (a part of the Trainer, as FaultHandling is: a mixin of its methods).

Steps are launched up to ``in_flight`` ahead; each summary is read once the next steps are
queued, so the host never waits for the device in the steady state. A committed step is
counted; a skipped one -- and the steps halted behind it -- goes to FaultHandling, and the run
goes on from where the repair put the state, replaying from the batch log. ``run(until)`` asks
``batch_fn`` for the batches; ``push(batch)`` / ``flush()`` take them from a loop the user owns,
the loop's state (a Loop) kept between the calls.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

from pimhbm.recovery.events import RunStats, log, persistent_fault
from pimhbm.recovery.summary import decode_step


@dataclasses.dataclass
class Loop:
    """The run loop's state, kept between the calls of a loop the user owns: the next step to
    launch, the steps in flight, how often each was launched, and the step skipped last and how
    often in a row."""

    step: int
    flight: collections.deque = dataclasses.field(default_factory=collections.deque)
    attempts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped_step: int | None = None
    skips: int = 0


class RunLoop:
    """The Trainer's loop (see the module's docstring)."""

    def run(self, until: int, campaign: Any = None,
            progress: Callable[[int, RunStats], None] | None = None) -> RunStats:
        """Trains up to step ``until`` (inclusive). ``campaign``: an object with
        ``before_step(trainer, step, attempt) -> grad fault spec or None`` and
        ``before_scrub(trainer, step)`` that injects faults (see pimhbm.campaign)."""
        if self.pushing:
            raise RuntimeError("this Trainer was made with an example batch: its steps come from "
                               "push(batch), and flush() ends them")
        return self._counted(Loop(self.next_step), until, True, campaign, progress)

    def push(self, batch: Any, campaign: Any = None,
             progress: Callable[[int, RunStats], None] | None = None) -> RunStats:
        """The next step's batch, from a loop the user owns (a Trainer made with an example
        batch in place of batch_fn): the step is launched, and the steps before it whose
        summaries are due are read, repaired and replayed from the batch log as ``run`` does --
        up to ``in_flight`` steps stay in flight. ``flush()`` after the last push."""
        if not self.pushing:
            raise RuntimeError("push() feeds a Trainer made with an example batch; this one asks "
                               "its batch_fn: call run(until)")
        self.pushed += 1
        self._pending[self.pushed] = batch
        self._loop = self._loop or Loop(self.next_step)
        return self._counted(self._loop, self.pushed, False, campaign, progress)

    def flush(self, campaign: Any = None,
              progress: Callable[[int, RunStats], None] | None = None) -> RunStats:
        """Every pushed step read and committed (or repaired and replayed): the end of a run."""
        loop, self._loop = self._loop or Loop(self.next_step), None
        return self._counted(loop, self.pushed, True, campaign, progress)

    def _pushed_batch(self, step: int) -> Any:
        if step not in self._pending:
            raise RuntimeError(f"the batch of step {step} was not pushed (push() gives the steps "
                               f"after {self.pushed} in order)")
        return self._pending.pop(step)

    def _counted(self, loop: Loop, until: int, drain: bool, campaign: Any,
                 progress: Callable | None) -> RunStats:
        if not self.programs.step:
            raise RuntimeError("call prewarm() first: every program is compiled ahead of time")
        with self.counter:  # compilations are counted while the run goes on
            try:
                return self._run(loop, until, drain, campaign, progress)
            finally:
                self.stats.compiles_after_prewarm = self.compiles

    def _run(self, loop: Loop, until: int, drain: bool, campaign: Any,
             progress: Callable | None) -> RunStats:
        """Launches the steps up to ``until``, reading each summary when ``in_flight`` steps
        wait (and, ``drain``, until none does)."""
        flight, attempts = loop.flight, loop.attempts
        if self.backup is not None and not self.backup.newest():
            # A first snapshot of the starting state, so that a host restore is always possible.
            self.snapshots.save_now(self.state, loop.step - 1, self.stats)
        while loop.step <= until or (drain and flight):
            if loop.step <= until and len(flight) < self.in_flight:
                attempts[loop.step] += 1
                flight.append(self._launch(loop.step, attempts[loop.step], campaign))
                loop.step += 1
                continue
            done = flight.popleft()
            summary, recheck = self._guarded(
                done.step, lambda: self.placement.fetch((done.summary, done.recheck)))
            report = decode_step(done.step, summary, self.layout, recheck)
            self.snapshots.confirm(done.step, report.committed, self.stats)
            if report.committed:
                # A replay from a host snapshot commits the steps before the skipped one first:
                # only the skipped step's own commit (or a later one) ends its count.
                if loop.skipped_step is not None and done.step >= loop.skipped_step:
                    loop.skipped_step = None
                self._commit(done, progress)
                continue
            if report.applied and not (report.nonfinite or report.kept or self._suspect(report)):
                # one copy: it left damaged chunks (and wrote every other element)
                loop.skipped_step, resume = None, self._left(report, flight, done, progress)
                self.stats.steps_replayed += loop.step - resume
                loop.step = resume
                continue
            loop.skips = loop.skips + 1 if loop.skipped_step == done.step else 1
            loop.skipped_step, seen = done.step, len(self.stats.incidents)
            replay_from, report = self._skip(report, flight, done)
            if loop.skips >= self.max_skips:
                raise persistent_fault(done.step, loop.skips, report.nonfinite, report.faulty,
                                       self.stats.incidents[seen:], kept=report.kept,
                                       bad_scalars=report.bad_scalars,
                                       loss_nonfinite=report.loss_nonfinite)
            self.stats.steps_replayed += loop.step - replay_from
            log.info("replaying steps %d-%d from the batch log", replay_from, loop.step - 1)
            loop.step = replay_from
        if drain:
            self.snapshots.finish(self._current_slot_verifies, self.stats)
        return self.stats

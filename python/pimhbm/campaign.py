"""Fault campaigns: a seeded plan of faults of every kind, injected into a live run, and the
check that each one was detected, located to its chunk and repaired.

Kinds:
  param_flip, master_flip, moment_flip  one bit of one element of the current state
  row_burst         1-2 KiB of one state tensor overwritten with random bytes (a failed row)
  grad_nonfinite    NaN/+Inf/-Inf written into one gradient value inside the step (transient)
  double_fault      the same bit flipped in the current state and in the device copy -- with
                    one copy of the state (pimhbm.inplace), in two chunks of one parity group;
                    where replicas exist, on one device only (repaired from a healthy replica),
                    otherwise on every device (the host snapshot)

A run without its own redundancy (pimhbm.update.adamw(device_copy=False), pimhbm.adamw(group=0):
replicas only) has no double faults, and its state faults each damage one device: the others
hold the healthy replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pimhbm import faults, parity
from pimhbm.recovery.events import Action, IncidentKind

# Repairs that rewrite a damaged chunk whole (from a copy, its parity group or a replica).
REWRITES = {Action.REPAIRED_FROM_DEVICE_COPY, Action.REPAIRED_FROM_PARITY, Action.REDONE_FROM_PARITY,
            Action.REPAIRED_FROM_REPLICA, Action.REBUILT_FROM_REPLICA}

KINDS = ("param_flip", "master_flip", "moment_flip", "row_burst", "grad_nonfinite", "double_fault")


@dataclasses.dataclass
class Planned:
    step: int
    kind: str
    path: str
    tensor: str  # "p", "master", "mu", "nu", or "gradient"
    element: int = 0
    bit: int = 0
    byte_offset: int = 0
    length: int = 0
    value: str = "nan"
    chunks: tuple[int, ...] = ()  # where it must be found
    device: int | None = None  # one device's state (None: every device's)
    incidents_before: int | None = None  # the run's incidents when it was injected
    detected: bool = False
    located: bool = False  # detected at its own chunk(s)
    repaired: bool = False


class Campaign:
    """``counts``: faults per kind; spread over steps [first_step, last_step] by ``seed``."""

    def __init__(self, trainer: Any, counts: dict[str, int], last_step: int, seed: int = 0,
                 first_step: int = 2):
        unknown = set(counts) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        self.rng = np.random.default_rng(seed)
        self.chunk_elems = trainer.opt.chunk_elems
        info = trainer.tensor_info()
        by_tensor = {}
        for path, tensor, n, size in info:
            by_tensor.setdefault(tensor, []).append((path, n, size))
        if "master" not in by_tensor and counts.get("master_flip"):
            raise ValueError("master_flip needs master weights")
        self.plan: list[Planned] = []
        self.replayed: set[int] = set()  # steps the trainer ran more than once
        self.one_device = not trainer.local_source  # every state fault on one device
        self.group = trainer.opt.group if trainer.one_copy else 0  # double faults: in a group
        # One-device faults all land on one replica (row of the mesh), so that the same chunk
        # never is damaged on every replica at once: the others stay healthy sources.
        self.shard = trainer.shard
        self.faulty_row = int(np.random.default_rng([seed, 1]).integers(
            max(1, len(trainer.devices) // trainer.shard)))
        if self.one_device:
            counts = {k: c for k, c in counts.items() if k != "double_fault"}
        for kind, count in counts.items():
            for _ in range(count):
                step = int(self.rng.integers(first_step, last_step + 1))
                self.plan.append(self._draw(kind, step, by_tensor, trainer))
        self.plan.sort(key=lambda f: f.step)
        self._by_step: dict[int, list[Planned]] = {}
        for f in self.plan:
            self._by_step.setdefault(f.step, []).append(f)
        self._avoid_cancelling(first_step, last_step)

    def _draw(self, kind, step, by_tensor, trainer) -> Planned:
        rng = self.rng
        pick = lambda tensors: (lambda t: (t, *by_tensor[t][int(rng.integers(len(by_tensor[t])))]))(
            tensors[int(rng.integers(len(tensors)))])
        if kind in ("param_flip", "master_flip", "moment_flip", "double_fault"):
            tensor, path, n, size = pick({"param_flip": ["p"], "master_flip": ["master"],
                                          "moment_flip": ["mu", "nu"],
                                          "double_fault": list(by_tensor)}[kind])
            e = int(rng.integers(n))
            device = None
            if (kind == "double_fault" or self.one_device) and len(trainer.devices) > trainer.shard:
                device = self._one_device()
            chunks = (e // self.chunk_elems,)
            if kind == "double_fault" and self.group:
                chunks += (self._partner(chunks[0], n),)
            return Planned(step, kind, path, tensor, element=e, bit=int(rng.integers(8 * size)),
                           chunks=tuple(sorted(chunks)), device=device)
        if kind == "row_burst":
            tensor, path, n, size = pick(list(by_tensor))
            nbytes = n * size
            length = min(nbytes, int(rng.integers(1024, 2049)))
            off = int(rng.integers(0, nbytes - length + 1))
            cb = self.chunk_elems * size
            device = self._one_device() if self.one_device else None
            return Planned(step, kind, path, tensor, byte_offset=off, length=length,
                           chunks=tuple(range(off // cb, (off + length - 1) // cb + 1)),
                           device=device)
        if kind == "grad_nonfinite":
            leaves = [(path, n, size) for path, n, size in by_tensor["p"]]
            li = int(rng.integers(len(leaves)))
            path, n, _ = leaves[li]
            e = int(rng.integers(n))
            return Planned(step, kind, path, "gradient", element=e,
                           value=["nan", "inf", "-inf"][int(rng.integers(3))],
                           chunks=(e // self.chunk_elems,))
        raise ValueError(kind)

    def _partner(self, chunk: int, n: int) -> int:
        """Another chunk of ``chunk``'s parity group (the next one, else the one before); the
        chunk itself where its group holds no other."""
        groups = parity.chunk_groups(-(-n // self.chunk_elems), self.group)
        members = np.flatnonzero(groups == groups[chunk])
        at = int(np.searchsorted(members, chunk))
        if at + 1 < len(members):
            return int(members[at + 1])
        return int(members[at - 1]) if at > 0 else chunk

    def _one_device(self) -> int:
        """A device of the faulty replica (its position in the mesh, row-major)."""
        return self.faulty_row * self.shard + int(self.rng.integers(self.shard))

    def _avoid_cancelling(self, first_step: int, last_step: int) -> None:
        # Two flips of the same bit before one step would undo each other, and a step carries
        # one gradient fault: move such a fault a step on.
        seen = set()
        for f in self.plan:
            key_of = lambda f: ((f.step, "gradient") if f.kind == "grad_nonfinite" else
                                (f.step, f.path, f.tensor, f.element, f.bit, f.kind != "row_burst"))
            while key_of(f) in seen:  # the next step, wrapping round inside the run
                f.step = f.step + 1 if f.step < last_step else first_step
            seen.add(key_of(f))
        self._by_step = {}
        for f in sorted(self.plan, key=lambda f: f.step):
            self._by_step.setdefault(f.step, []).append(f)

    # -- called by the trainer -----------------------------------------------------------------

    def before_step(self, trainer: Any, step: int, attempt: int) -> faults.GradientFault | None:
        if attempt != 1:  # faults are transient: a replay runs clean
            self.replayed.add(step)
            return None
        grad = None
        for f in self._by_step.get(step, []):
            f.incidents_before = len(trainer.stats.incidents)
            if f.kind == "grad_nonfinite":
                leaf = trainer.paths.index(f.path)
                grad = faults.GradientFault(leaf, faults.spec(faults.NONFINITE,
                                                              offset=f.element, value=f.value))
            elif f.kind == "row_burst":
                trainer.inject(f.path, f.tensor, faults.spec(
                    faults.OVERWRITE, offset=f.byte_offset, length=f.length,
                    seed=int(self.rng.integers(2**31))), device=f.device)
            else:
                size = next(s for p, t, _, s in trainer.tensor_info()
                            if p == f.path and t == f.tensor)
                fault = faults.spec(faults.FLIP_BIT, offset=f.element * size + f.bit // 8,
                                    bit=f.bit % 8)
                trainer.inject(f.path, f.tensor, fault, device=f.device)
                if f.kind == "double_fault" and self.group:  # the same bit of the partner
                    for c in set(f.chunks) - {f.element // self.chunk_elems}:
                        moved = (c - f.element // self.chunk_elems) * self.chunk_elems * size
                        trainer.inject(f.path, f.tensor, faults.spec(
                            faults.FLIP_BIT, offset=f.element * size + moved + f.bit // 8,
                            bit=f.bit % 8), device=f.device)
                elif f.kind == "double_fault":
                    trainer.inject(f.path, f.tensor, fault, into_copy=True, device=f.device)
        return grad

    def before_scrub(self, trainer: Any, step: int) -> None:
        pass

    # -- the verdict ---------------------------------------------------------------------------

    def check(self, stats: Any) -> dict[str, dict[str, int]]:
        """Marks each planned fault detected (an incident at its step names every chunk it
        damaged) and repaired (that incident's action succeeded); counts by kind."""
        found: dict[tuple[int, str, str, int], Action] = {}
        unlisted: set[int] = set()  # steps whose non-finite gradients overflowed the list
        gradient_steps: set[int] = set()  # steps with an incident of non-finite gradients
        for inc in stats.incidents:
            for loc in inc.locations:
                found[(inc.step, loc.leaf, loc.tensor, loc.chunk)] = inc.action
            if inc.kind is IncidentKind.GRADIENT:
                gradient_steps.add(inc.step)
                if inc.unlisted:
                    unlisted.add(inc.step)
        table = {k: {"injected": 0, "detected": 0, "repaired": 0, "missed": 0, "unlocated": 0,
                     "overwritten": 0} for k in KINDS}
        for f in self.plan:
            actions = [found.get((f.step, f.path, f.tensor, c)) for c in f.chunks]
            f.detected = all(a is not None for a in actions)
            f.located = f.detected
            if not f.detected and f.kind == "grad_nonfinite" and f.step in unlisted:
                # Its step was skipped for non-finite gradients in more chunks than the summary
                # lists (damaged state upstream poisoned the whole gradient): detected and kept
                # out of the update, but not told apart from the rest.
                f.detected, actions = True, [Action.SKIPPED_AND_REPLAYED]
            f.repaired = f.detected and all(a.repaired for a in actions)
            if f.kind == "grad_nonfinite":
                # Its step was halted behind another fault, or cancelled by damaged state, and
                # ran again without it: it reached nothing. (Had its own values stopped the
                # step, the step would have an incident of non-finite gradients.)
                overwritten = (not f.detected and f.step in self.replayed and
                               f.step not in gradient_steps)
            else:
                overwritten = not f.detected and self._overwritten(f, stats.incidents)
            row = table[f.kind]
            row["injected"] += 1
            row["detected"] += f.detected
            row["repaired"] += f.repaired or overwritten
            row["missed"] += not f.detected and not overwritten
            row["overwritten"] += overwritten
            row["unlocated"] += f.detected and not f.located
        return {k: v for k, v in table.items() if v["injected"]}


    @staticmethod
    def _overwritten(f: Planned, incidents: list) -> bool:
        """Whether, after ``f`` was injected and before any check named it, the state came back
        from a host snapshot or its chunk was rewritten whole by the repair of damage another
        step found there (one still in flight when it was injected). With one copy of the state
        a step that damage to its parameters cancels never runs the update, which is what
        checks the master weights and moments: damage there can be overwritten so."""
        if f.incidents_before is None:
            return False
        mine = {(f.path, f.tensor, c) for c in f.chunks}
        for inc in incidents[f.incidents_before:]:
            if inc.action is Action.RESTORED_FROM_SNAPSHOT:
                return True
            if any((l.leaf, l.tensor, l.chunk) in mine for l in inc.locations):
                return inc.step != f.step and inc.action in REWRITES
        return False


def unlocated_note(table: dict[str, dict[str, int]]) -> str | None:
    """A line for a table from Campaign.check that counted faults detected but not located, or
    overwritten by a host restore before any check read them."""
    unlocated = sum(r["unlocated"] for r in table.values())
    overwritten = sum(r.get("overwritten", 0) for r in table.values())
    notes = []
    if unlocated:
        notes.append(f"{unlocated} NaN/Inf gradient fault(s) fell on steps whose whole gradient "
                     "was non-finite from damaged state upstream: detected and kept out of the "
                     "update, not told apart from the rest")
    if overwritten:
        notes.append(f"{overwritten} fault(s) were overwritten before any check read them -- by "
                     "a host restore of damage found at the same step, or by the repair of the "
                     "same chunk found by the step before; a NaN/Inf gradient, by its step being "
                     "halted or cancelled by another fault and run again without it: counted "
                     "repaired, not detected")
    return f"({'; '.join(notes)})" if notes else None

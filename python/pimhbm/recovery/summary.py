"""What a step (or a scrub) leaves on the device for the host, and what the host reads in it.

In the programs: a :class:`StepSummary` per device -- the verdict, its counts, and the first
``capacity`` entries of its fault maps -- built from the update's report by one
pimhbm_fault_list call a list (csrc/summary/fault_list.h): no scatter, no sort, no
concatenation of the per-leaf maps and no reduction of them around the call. On the host, one
step later: :func:`decode_step` turns the fetched summary (a row per device) into a
:class:`StepReport` of located chunks; :func:`merge` joins the reports of a skipped step and of
those halted behind it into the one :class:`FaultReport` a repair plans from.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import _core
from pimhbm._ffi import ensure_registered, unbatched_call
from pimhbm.inplace_calls import saturated
from pimhbm.step_scalars import unusable
from pimhbm.recovery.layout import ChunkDamage, ChunkRef, Damage, StateLayout


class FaultList(NamedTuple):
    """The first entries of a per-chunk map (over every leaf, in global chunk order)."""

    index: jax.Array  # int32 [..., capacity]: global chunk index, -1 past the last entry
    value: jax.Array  # int32 [..., capacity]: the map's value there


class StepSummary(NamedTuple):
    """One step's report: in the programs a device's own; fetched, a row per device."""

    committed: jax.Array  # int32: the step was applied whole (the verdict is global)
    applied: jax.Array  # int32: the update ran (one copy: it may have left damaged chunks)
    # int32: this device's NaN/Inf gradient values (two slots: elements whose gradient or new
    # values are not finite, one count)
    grad_nonfinite: jax.Array
    faulty_chunks: jax.Array  # int32: this device's chunks whose digest did not match
    faults: FaultList  # value: the chunk's Damage bits
    grad_faults: FaultList  # value: NaN/Inf gradient values in the chunk (two slots: as above)
    disagree: FaultList  # value: the Damage bits of tensors whose replicas' digests differ
    # int32: elements whose new values the update found non-finite and kept as they were (one
    # copy; the step's count, the same on every device, each element counted on every device
    # that holds it; two slots: the gradients' count, which holds them too)
    kept: jax.Array
    # int32: 1 where the step's learning rate or bias corrections could not make finite values
    # (the update applied nothing; the step's verdict, every device's the same)
    bad_scalars: jax.Array
    # int32: speculative checks (one copy), the parameter chunks the update found damaged, every
    # device (the step's count): their damage may have reached the gradients; else 0
    suspect: jax.Array
    # int32: 1 where this device's loss was not finite and held the step before any write (one
    # copy, with the gradients checked in the update); else 0
    loss_nonfinite: jax.Array


class ScrubSummary(NamedTuple):
    """A scrub's report: the damaged chunks of the current slot and of the device copy."""

    faults: FaultList  # value: Damage bits (the device copy's shifted by 4)
    marked: jax.Array  # int32: the chunks marked (more than the list holds: not all listed)


def scrub_summary(maps: list[jax.Array], capacity: int) -> ScrubSummary:
    """A scrub's summary of its per-leaf maps of Damage bits (see :func:`listed`)."""
    found = listed(maps, capacity)
    return ScrubSummary(found.faults, found.nonzero)


class Listed(NamedTuple):
    """A fault list and the counts of its maps, from one pimhbm_fault_list call."""

    faults: FaultList
    nonzero: jax.Array  # int32: the maps' non-zero entries (saturating)
    total: jax.Array  # int32: the sum of their values (saturating)


def listed(maps: list[jax.Array], capacity: int) -> Listed:
    """The first ``capacity`` non-zero entries of the per-leaf int32 ``maps`` read one after
    another (positions in that concatenation, in order), with their counts: one
    pimhbm_fault_list call, whatever the number of leaves. For maps that are a device's own
    (inside shard_map): under plain jit the call would gather sharded maps."""
    ensure_registered()
    lay = _list_layout()
    rows = sum(-(-math.prod(m.shape) // lay["range_entries"]) for m in maps)
    out_types = [jax.ShapeDtypeStruct((capacity,), jnp.int32)] * 2 + [
        jax.ShapeDtypeStruct((lay["totals"], 2), jnp.uint32),
        jax.ShapeDtypeStruct((rows * lay["range_bytes"],), jnp.uint8)]
    index, value, totals, _ = unbatched_call("pimhbm_fault_list", out_types, _NO_VMAP)(*maps)
    counts = saturated(totals)
    return Listed(FaultList(index, value), counts[0], counts[1])


@functools.cache
def _list_layout() -> dict:
    """The sizes a pimhbm_fault_list call's scratch result is made of (csrc/summary)."""
    return _core.fault_list_layout()


_NO_VMAP = "a step's fault list is one device's, of one step (list each member's maps alone)"


def fault_list(maps: list[jax.Array], capacity: int) -> FaultList:
    """The first ``capacity`` non-zero entries of the per-leaf ``maps`` (see :func:`listed`)."""
    return listed(maps, capacity).faults


def step_summary(report: Any, treedef: Any, capacity: int,
                 disagree: list[jax.Array]) -> StepSummary:
    """This device's summary of a two-slot update's report (pimhbm.update.UpdateReport) and of the
    replicas' disagreement maps (per leaf; none without replicas)."""
    committed = report.committed.astype(jnp.int32)
    return StepSummary(
        committed, committed, report.local_counts[1], report.local_counts[0],
        fault_list(treedef.flatten_up_to(report.fault_maps), capacity),
        fault_list(treedef.flatten_up_to(report.grad_nonfinite_maps), capacity),
        fault_list(disagree, capacity), report.grad_nonfinite,
        unusable(report.scalars).astype(jnp.int32), jnp.int32(0), jnp.int32(0))


def inplace_summary(report: Any, treedef: Any, capacity: int, disagree: list[jax.Array],
                    loss_nonfinite: jax.Array) -> StepSummary:
    """The same for an in-place update's report (pimhbm.inplace.UpdateReport): committed when
    it ran, no device found damage, and it kept no element (a new value that was not finite,
    or a non-finite gradient value where the update checks them itself: either way it applied
    the step in part); this device's counts from its own maps, by the lists' calls;
    ``loss_nonfinite``: whether this device's loss held the step (OneCopy._nonfinite_loss)."""
    faults = listed(treedef.flatten_up_to(report.fault_maps), capacity)
    grads = listed(treedef.flatten_up_to(report.grad_nonfinite_maps), capacity)
    # (committed already holds no non-finite gradient value: the checks' count holds the
    # update back; where the update checks them itself, they are its kept elements)
    whole = report.committed & (report.digest_faults == 0)
    return StepSummary(
        whole.astype(jnp.int32),
        report.applied.astype(jnp.int32), grads.total, faults.nonzero, faults.faults,
        grads.faults, fault_list(disagree, capacity), report.kept,
        unusable(report.scalars).astype(jnp.int32), report.suspect, loss_nonfinite)


# -- on the host ---------------------------------------------------------------------------------

def entries(faults: FaultList, device: int) -> list[tuple[int, int]]:
    """(global chunk index, value) of one device's row of a fetched fault list."""
    return [(int(i), int(v)) for i, v in zip(faults.index[device], faults.value[device]) if i >= 0]


class StepReport(NamedTuple):
    """What one step's summary says, located."""

    step: int
    committed: bool
    applied: bool  # the update ran (one copy: committed, or it left damaged chunks to redo)
    damaged: tuple[ChunkDamage, ...]  # listed fault-list entries, every device
    state: tuple[ChunkRef, ...]  # the damaged chunks they name
    overflow: bool  # a device had more damaged chunks than its list holds
    grads: tuple[ChunkRef, ...]  # chunks with NaN/Inf gradient values (two slots: or new values)
    grads_unlisted: bool  # more NaN/Inf gradient values than the listed chunks hold
    nonfinite: int  # NaN/Inf gradient values, every device (two slots: or new values)
    faulty: int  # damaged chunks, every device
    damaged_devices: np.ndarray  # bool per device: it reported a damaged chunk
    disagree: tuple[ChunkRef, ...]  # chunks whose replicas' digests differ (each device's)
    miscomputed: tuple[int, ...] = ()  # devices whose gradients, computed again, differ
    kept: int = 0  # elements whose new values were not finite, kept (one copy: applied in part)
    bad_scalars: bool = False  # the learning rate or a bias correction could not make finite values
    # speculative checks: the update found a damaged parameter chunk (listed or not), whose
    # damage the step's gradients may have read
    suspect: bool = False
    loss_nonfinite: bool = False  # a device's loss was not finite: it held the step


def decode_step(step: int, s: StepSummary, layout: StateLayout,
                recheck: np.ndarray | None = None) -> StepReport:
    """A fetched summary (a row per device) as located chunks; ``recheck``: a sampled step's
    re-execution (per device, the gradient leaves whose digests differed): the step was undone
    where any did."""
    damaged, state, grads, overflow, unlisted, disagree = [], [], [], False, False, []
    for device in range(s.committed.shape[0]):
        disagree += [loc for i, b in entries(s.disagree, device)
                     for loc in layout.locate(ChunkDamage(device, i, Damage(b)))]
        listed = [ChunkDamage(device, i, Damage(b)) for i, b in entries(s.faults, device)]
        overflow |= int(s.faulty_chunks[device]) > len(listed)
        damaged += listed
        state += [loc for entry in listed for loc in layout.locate(entry)]
        counts = entries(s.grad_faults, device)
        unlisted |= int(s.grad_nonfinite[device]) > sum(c for _, c in counts)
        grads += [layout.gradient_chunk(device, i) for i, _ in counts]
    miscomputed = () if recheck is None else tuple(int(d) for d in np.flatnonzero(recheck))
    committed = bool(s.committed[0]) and not miscomputed
    # Undone by its re-execution (two slots), a step was not applied either.
    applied = committed or (bool(s.applied[0]) and not miscomputed)
    return StepReport(step, committed, applied, tuple(damaged),
                      tuple(state), overflow, tuple(grads), unlisted, int(s.grad_nonfinite.sum()),
                      int(s.faulty_chunks.sum()), np.asarray(s.faulty_chunks) > 0,
                      tuple(disagree), miscomputed, int(s.kept.max()),
                      bool(s.bad_scalars.any()), bool(s.suspect.any()),
                      bool(s.loss_nonfinite.any()))


def whole_chunks(report: StepReport, layout: StateLayout) -> StepReport:
    """``report`` with every tensor of each damaged chunk named: an in-place update leaves a
    chunk it found damaged unwritten in every tensor, so all of them are a step behind."""
    every = Damage(0)
    for k in layout.names:
        every |= Damage.of(k)
    damaged = tuple(ChunkDamage(e.device, e.index, every) for e in report.damaged)
    return report._replace(damaged=damaged,
                           state=tuple(loc for e in damaged for loc in layout.locate(e)))


class FaultReport(NamedTuple):
    """The damage of a skipped step and of the steps halted behind it (damage persists until
    repaired: a later step may name more of it)."""

    first_step: int
    steps: tuple[StepReport, ...]
    damage: dict[int, Damage]  # global chunk index -> tensors damaged there on some device
    chunks: tuple[ChunkRef, ...]  # every damaged chunk, sorted
    overflow: bool
    damaged_devices: np.ndarray  # bool per device
    disagree: tuple[ChunkRef, ...]  # chunks whose replicas' digests differ, sorted

    @property
    def state_damaged(self) -> bool:
        """Damage listed, or counted past a list (overflow: not every chunk is named)."""
        return bool(self.damage) or self.overflow


def merge(reports: list[StepReport]) -> FaultReport:
    damage: dict[int, Damage] = {}
    for r in reports:
        for entry in r.damaged:
            damage[entry.index] = damage.get(entry.index, Damage(0)) | entry.damage
    chunks = sorted({loc for r in reports for loc in r.state})
    devices = np.logical_or.reduce([r.damaged_devices for r in reports])
    disagree = sorted({loc for r in reports for loc in r.disagree})
    return FaultReport(reports[0].step, tuple(reports), dict(sorted(damage.items())),
                       tuple(chunks), any(r.overflow for r in reports), devices, tuple(disagree))


def scrub_overflowed(s: ScrubSummary) -> np.ndarray:
    """Per device (bool): its scrub marked more chunks than its list holds."""
    return np.array([int(s.marked[d]) > len(entries(s.faults, d))
                     for d in range(s.marked.shape[0])], bool)


def decode_scrub(s: ScrubSummary) -> list[ChunkDamage]:
    """A fetched scrub summary's entries, every device."""
    return [ChunkDamage(device, i, Damage(b))
            for device in range(s.faults.index.shape[0]) for i, b in entries(s.faults, device)]

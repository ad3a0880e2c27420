"""What a step (or a scrub) leaves on the device for the host, and what the host reads in it.

In the programs: a :class:`StepSummary` per device -- the verdict, its counts, and the first
``capacity`` entries of its fault maps -- built from the update's report without a scatter or a
sort. On the host, one step later: :func:`decode_step` turns the fetched summary (a row per
device) into a :class:`StepReport` of located chunks; :func:`merge` joins the reports of a
skipped step and of those halted behind it into the one :class:`FaultReport` a repair plans
from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm.inplace import concatenated
from pimhbm.recovery.layout import ChunkDamage, ChunkRef, Damage, StateLayout


def first_nonzero(flat: jax.Array, k: int) -> jax.Array:
    """int32[k]: the positions of the first k non-zero entries of ``flat`` in order, -1 past the
    last. As ``jnp.nonzero(flat, size=k, fill_value=-1)``, without its scatter: under XLA's
    deterministic ops a scatter becomes sorts of the whole array (~0.7 ms each for the ~10^5
    chunks of 2 Llama-3-8B layers, on every step). Entry j is where the running count of
    non-zeros first reaches j + 1, found in two levels so that the map is read once: the block
    of ``_BLOCK`` entries where the count reaches j + 1 (k comparisons a block), then the place
    in that block (k x _BLOCK). One level (k x n comparisons) read the map k times."""
    n = flat.shape[0]
    if n == 0:
        return jnp.full((k,), -1, jnp.int32)
    blocks = -(-n // _BLOCK)
    nz = jnp.pad((flat != 0).astype(jnp.int32), (0, blocks * _BLOCK - n)).reshape(blocks, _BLOCK)
    per_block = jnp.sum(nz, axis=1, dtype=jnp.int32)
    through = jnp.cumsum(per_block)  # non-zeros up to each block's end
    target = jnp.arange(1, k + 1, dtype=jnp.int32)
    block = jnp.searchsorted(through, target, side="left", method="compare_all")
    found = block < blocks  # fewer than j + 1 non-zeros in all: -1
    block = jnp.minimum(block, blocks - 1)
    before = through[block] - per_block[block]  # non-zeros before the block
    within = jnp.cumsum(nz[block], axis=1)  # (k, _BLOCK): running counts inside each block
    place = jnp.sum(within < (target - before)[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(found, block * _BLOCK + place, -1).astype(jnp.int32)


_BLOCK = 1024  # entries a block in first_nonzero's first level


class FaultList(NamedTuple):
    """The first entries of a per-chunk map (over every leaf, in global chunk order)."""

    index: jax.Array  # int32 [..., capacity]: global chunk index, -1 past the last entry
    value: jax.Array  # int32 [..., capacity]: the map's value there


class StepSummary(NamedTuple):
    """One step's report: in the programs a device's own; fetched, a row per device."""

    committed: jax.Array  # int32: the step was applied whole (the verdict is global)
    applied: jax.Array  # int32: the update ran (one copy: it may have left damaged chunks)
    grad_nonfinite: jax.Array  # int32: this device's NaN/Inf gradient values
    faulty_chunks: jax.Array  # int32: this device's chunks whose digest did not match
    faults: FaultList  # value: the chunk's Damage bits
    grad_faults: FaultList  # value: NaN/Inf gradient values in the chunk
    disagree: FaultList  # value: the Damage bits of tensors whose replicas' digests differ


class ScrubSummary(NamedTuple):
    """A scrub's report: the damaged chunks of the current slot and of the device copy."""

    faults: FaultList  # value: Damage bits (the device copy's shifted by 4)


def fault_list(maps: list[jax.Array] | jax.Array, capacity: int) -> FaultList:
    """The first ``capacity`` non-zero entries of the concatenated per-leaf ``maps`` (or of
    their concatenation, flat)."""
    flat_maps = maps if isinstance(maps, jax.Array) else concatenated(maps)
    idx = first_nonzero(flat_maps, capacity)
    if flat_maps.shape[0] == 0:  # no map (no replicas to disagree): an empty list
        return FaultList(idx, jnp.zeros((capacity,), jnp.int32))
    return FaultList(idx, jnp.where(idx >= 0, flat_maps[jnp.maximum(idx, 0)], 0))


def step_summary(report: Any, treedef: Any, capacity: int,
                 disagree: list[jax.Array]) -> StepSummary:
    """This device's summary of a two-slot update's report (pimhbm.update.UpdateReport) and of the
    replicas' disagreement maps (per leaf; none without replicas)."""
    committed = report.committed.astype(jnp.int32)
    return StepSummary(
        committed, committed, report.local_counts[1], report.local_counts[0],
        fault_list(treedef.flatten_up_to(report.fault_maps), capacity),
        fault_list(treedef.flatten_up_to(report.grad_nonfinite_maps), capacity),
        fault_list(disagree, capacity))


def inplace_summary(report: Any, treedef: Any, capacity: int,
                    disagree: list[jax.Array]) -> StepSummary:
    """The same for an in-place update's report (pimhbm.inplace.UpdateReport): committed when
    it ran and no device found damage; this device's counts from its own maps."""
    faults = concatenated(treedef.flatten_up_to(report.fault_maps))
    grads = concatenated(treedef.flatten_up_to(report.grad_nonfinite_maps))
    return StepSummary(
        (report.applied & (report.digest_faults == 0)).astype(jnp.int32),
        report.applied.astype(jnp.int32), jnp.sum(grads, dtype=jnp.int32),
        jnp.sum(faults != 0, dtype=jnp.int32),
        fault_list(faults, capacity), fault_list(grads, capacity), fault_list(disagree, capacity))


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
    grads: tuple[ChunkRef, ...]  # chunks with NaN/Inf gradient values
    grads_unlisted: bool  # more NaN/Inf gradient values than the listed chunks hold
    nonfinite: int  # NaN/Inf gradient values, every device
    faulty: int  # damaged chunks, every device
    damaged_devices: np.ndarray  # bool per device: it reported a damaged chunk
    disagree: tuple[ChunkRef, ...]  # chunks whose replicas' digests differ (each device's)
    miscomputed: tuple[int, ...] = ()  # devices whose gradients, computed again, differ


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
                      tuple(disagree), miscomputed)


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
        return bool(self.damage)


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


def decode_scrub(s: ScrubSummary) -> list[ChunkDamage]:
    """A fetched scrub summary's entries, every device."""
    return [ChunkDamage(device, i, Damage(b))
            for device in range(s.faults.index.shape[0]) for i, b in entries(s.faults, device)]

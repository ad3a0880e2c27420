"""Repair plans: which chunk comes from where, in batches that fit the programs' fixed shapes.

Pure functions of the layout and of located damage (no devices): the repair programs take
chunk lists of a fixed capacity per tensor, so a plan is cut into batches of at most
``capacity`` chunks of each tensor.
"""

from __future__ import annotations

import collections
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from pimhbm.recovery.layout import ChunkDamage, ChunkRef, StateLayout, Vote


class TensorChunk(NamedTuple):
    """A chunk of one tensor, the same on every device it is listed for."""

    leaf: str
    tensor: str
    chunk: int


def local_work(entries: Iterable[ChunkDamage], layout: StateLayout, *,
               in_copy: bool = False) -> list[TensorChunk]:
    """The chunks to rewrite from the device copy (or, ``in_copy``, in the device copy from the
    state): every device repairs the same chunks of its copy; where a device's chunk is intact
    the repair writes the same bytes again."""
    return sorted({TensorChunk(*loc[1:]) for e in entries
                   for loc in layout.locate(e, in_copy=in_copy)})


def local_batches(work: list[TensorChunk], layout: StateLayout,
                  capacity: int) -> Iterator[tuple[np.ndarray, list[TensorChunk]]]:
    """(chunk lists int32 (leaves, tensors, capacity), -1 = none; the chunks in them)."""
    while work:
        lists = np.full((len(layout.paths), len(layout.names), capacity), -1, np.int32)
        fill: collections.Counter = collections.Counter()
        batch, rest = [], []
        for entry in work:
            at = layout.leaf_index(entry.leaf), layout.tensor_index(entry.tensor)
            if fill[at] < capacity:
                lists[at][fill[at]] = entry.chunk
                fill[at] += 1
                batch.append(entry)
            else:
                rest.append(entry)
        yield lists, batch
        work = rest


class ReplicaPull(NamedTuple):
    """A chunk of one shard column pulled from replica ``source`` into replicas ``targets``."""

    column: int
    leaf: str
    tensor: str
    chunk: int
    source: int  # replica (index along 'dp') whose copy of the chunk is healthy
    targets: tuple[int, ...]  # replicas whose copy of it is damaged


def plan_replica_pulls(damaged: Iterable[ChunkRef], layout: StateLayout,
                       replicas: int) -> list[ReplicaPull] | None:
    """Each damaged chunk from the first replica (of its shard column) that did not report it;
    None when some chunk is damaged on every replica."""
    rows: dict[tuple, set[int]] = collections.defaultdict(set)
    for loc in damaged:
        rows[layout.column_of(loc.device), loc.leaf, loc.tensor, loc.chunk].add(
            layout.replica_of(loc.device))
    pulls = []
    for (col, leaf, tensor, chunk), bad in sorted(rows.items()):
        healthy = [r for r in range(replicas) if r not in bad]
        if not healthy:
            return None
        pulls.append(ReplicaPull(col, leaf, tensor, chunk, healthy[0], tuple(sorted(bad))))
    return pulls


class ReplicaBatch(NamedTuple):
    lists: np.ndarray  # int32 (shard, leaves, tensors, capacity): the chunk, -1 = none
    sources: np.ndarray  # int32, the same shape: the replica it comes from
    slots: list[tuple[ReplicaPull, int]]  # each pull and its place in the lists


def replica_batches(pulls: list[ReplicaPull], layout: StateLayout,
                    capacity: int) -> Iterator[ReplicaBatch]:
    """The pulls in batches of at most ``capacity`` chunks per (column, leaf, tensor)."""
    while pulls:
        shape = (layout.shard, len(layout.paths), len(layout.names), capacity)
        lists, sources = np.full(shape, -1, np.int32), np.zeros(shape, np.int32)
        fill: collections.Counter = collections.Counter()
        slots, rest = [], []
        for p in pulls:
            at = p.column, layout.leaf_index(p.leaf), layout.tensor_index(p.tensor)
            if fill[at] < capacity:
                lists[at][fill[at]], sources[at][fill[at]] = p.chunk, p.source
                slots.append((p, fill[at]))
                fill[at] += 1
            else:
                rest.append(p)
        yield ReplicaBatch(lists, sources, slots)
        pulls = rest


def pull_sources(pulls: Iterable[ReplicaPull], layout: StateLayout) -> tuple[int, ...]:
    """The devices the pulls read from."""
    return tuple(sorted({layout.device_at(p.source, p.column) for p in pulls}))


class RebuildPlan(NamedTuple):
    """Whole device states rebuilt from a replica that reported no damage."""

    targets: np.ndarray  # int32 (replicas, shard): 1 = rebuild this device
    sources: np.ndarray  # int32 (shard,): per shard column, the replica to copy

    def devices(self, layout: StateLayout) -> tuple[int, ...]:
        return tuple(layout.device_at(int(r), int(c)) for r, c in zip(*np.nonzero(self.targets)))

    def source_devices(self, layout: StateLayout) -> tuple[int, ...]:
        cols = sorted({int(c) for c in np.nonzero(self.targets)[1]})
        return tuple(sorted({layout.device_at(int(self.sources[c]), c) for c in cols}))


def plan_rebuild(damaged_devices: np.ndarray, layout: StateLayout,
                 replicas: int) -> RebuildPlan | None:
    """Every damaged device rebuilt from the first clean replica of its column; None when a
    column has no clean replica."""
    grid = np.asarray(damaged_devices, np.int32).reshape(replicas, layout.shard)
    sources = np.zeros(layout.shard, np.int32)
    for col in range(layout.shard):
        clean = np.flatnonzero(grid[:, col] == 0)
        if clean.size == 0:
            return None
        sources[col] = clean[0]
    return RebuildPlan(grid, sources)


def rebuild_pulls(plan: RebuildPlan, layout: StateLayout) -> list[ReplicaPull]:
    """A rebuild as chunk pulls: every chunk of every tensor of each damaged device."""
    targets: dict[tuple, list[int]] = collections.defaultdict(list)
    for row, col in zip(*np.nonzero(plan.targets)):
        for li, leaf in enumerate(layout.paths):
            for tensor in layout.names:
                for chunk in range(layout.nchunks[li]):
                    targets[int(col), leaf, tensor, chunk].append(int(row))
    return [ReplicaPull(*key, int(plan.sources[key[0]]), tuple(rows))
            for key, rows in targets.items()]


def vote_batches(disagree: Iterable[ChunkRef], layout: StateLayout,
                 capacity: int) -> Iterator[ReplicaBatch]:
    """The chunks whose replicas disagree, once per shard column, in batches for the vote
    program (the sources are not known yet: 0)."""
    keys = sorted({(layout.column_of(loc.device), loc.leaf, loc.tensor, loc.chunk)
                   for loc in disagree})
    yield from replica_batches([ReplicaPull(*key, 0, ()) for key in keys], layout, capacity)


def plan_majority_pulls(batch: ReplicaBatch, votes: np.ndarray, layout: StateLayout,
                        replicas: int) -> list[ReplicaPull] | None:
    """From a vote (devices, leaves, tensors, capacity): each listed chunk from the first
    replica that holds the majority's digest into those that do not; None when some chunk has
    no majority (two replicas that differ: neither can be told right)."""
    pulls = []
    for p, slot in batch.slots:
        at = layout.leaf_index(p.leaf), layout.tensor_index(p.tensor), slot
        rows = [Vote(int(votes[(layout.device_at(r, p.column), *at)])) for r in range(replicas)]
        if Vote.MAJORITY not in rows:
            return None
        minority = tuple(r for r, v in enumerate(rows) if v is Vote.MINORITY)
        if minority:
            pulls.append(p._replace(source=rows.index(Vote.MAJORITY), targets=minority))
    return pulls

"""The recovery engine's host-side decisions, without devices: decoding a step's summary into
located chunks, and planning where each damaged chunk comes from, on fresh random layouts."""

import itertools

import numpy as np
import pytest

from pimhbm.recovery.layout import ChunkDamage, ChunkRef, Damage, StateLayout
from pimhbm.recovery.planner import (TensorChunk, local_batches, local_work, plan_rebuild,
                                     plan_replica_pulls, rebuild_pulls, replica_batches)
from pimhbm.recovery.summary import FaultList, StepSummary, decode_step, merge


def random_layout(rng, shard=1) -> StateLayout:
    leaves = int(rng.integers(1, 6))
    chunk = 16 * int(rng.integers(1, 8))
    sizes = tuple(int(rng.integers(0, 9 * chunk)) for _ in range(leaves))  # 0 and ragged too
    names = ("p", "master", "mu", "nu") if rng.random() < 0.5 else ("p", "mu", "nu")
    return StateLayout(tuple(f"leaf{i}" for i in range(leaves)), names, (np.float32,) * leaves,
                       sizes, (False,) * leaves, chunk, shard)


def every_chunk(layout, devices):
    return [ChunkRef(d, leaf, t, c) for d in range(devices)
            for leaf, n in zip(layout.paths, layout.nchunks) for t in layout.names
            for c in range(n)]


def test_damage_bits_name_their_tensors():
    d = Damage.P | Damage.NU | Damage.COPY_MU
    assert d.tensors() == ["p", "nu"] and d.tensors(in_copy=True) == ["mu"]
    assert d.in_state and d.in_copy and not Damage.COPY_P.in_state
    assert Damage.of("master", in_copy=True) is Damage.COPY_MASTER


def test_locate_maps_global_chunk_indices_to_leaves(rng):
    for _ in range(20):
        layout = random_layout(rng)
        base = layout.chunk_base
        for li, n in enumerate(layout.nchunks):
            for c in ({0, n - 1} if n else set()):
                assert layout.leaf_of(int(base[li]) + c) == (li, c)
                refs = layout.locate(ChunkDamage(3, int(base[li]) + c, Damage.MU | Damage.P))
                assert refs == [ChunkRef(3, layout.paths[li], "p", c),
                                ChunkRef(3, layout.paths[li], "mu", c)]


def summary_of(rows, capacity):
    """A fetched StepSummary from per-device lists of (index, bits) and (index, count)."""
    def fl(lists):
        idx = np.full((len(lists), capacity), -1, np.int32)
        val = np.zeros_like(idx)
        for d, entries in enumerate(lists):
            for k, (i, v) in enumerate(entries[:capacity]):
                idx[d, k], val[d, k] = i, v
        return FaultList(idx, val)
    faults = [r["faults"] for r in rows]
    grads = [r["grads"] for r in rows]
    committed = np.array([r["committed"] for r in rows], np.int32)
    return StepSummary(committed, committed,
                       np.array([sum(c for _, c in g) + r.get("extra", 0)
                                 for g, r in zip(grads, rows)], np.int32),
                       np.array([len(f) for f in faults], np.int32), fl(faults), fl(grads),
                       fl([r.get("disagree", []) for r in rows]),
                       np.array([r.get("kept", 0) for r in rows], np.int32),
                       np.array([r.get("bad_scalars", 0) for r in rows], np.int32),
                       np.array([r.get("suspect", 0) for r in rows], np.int32),
                       np.array([r.get("loss_nonfinite", 0) for r in rows], np.int32))


def test_decode_step_locates_every_listed_chunk_and_notices_overflow(rng):
    layout = random_layout(rng)
    total = int(layout.chunk_base[-1])
    if total == 0:
        pytest.skip("an empty layout drawn")
    devices, capacity = 4, 3
    bits = [int(b) for b in (Damage.P, Damage.MU, Damage.NU, Damage.P | Damage.NU)]
    rows = []
    for d in range(devices):
        n = int(rng.integers(0, capacity + 2))  # sometimes more than the list holds
        idx = sorted(rng.choice(total, size=min(n, total), replace=False).tolist())
        rows.append({"committed": 0, "faults": [(i, bits[int(rng.integers(4))]) for i in idx],
                     "grads": [(int(rng.integers(total)), 2)] if d == 1 else [],
                     "extra": 5 if d == 1 else 0,
                     "disagree": [(idx[0], int(Damage.MU))] if d == 3 and idx else []})
    report = decode_step(7, summary_of(rows, capacity), layout)
    assert report.step == 7 and not report.committed
    assert report.overflow == any(len(r["faults"]) > capacity for r in rows)
    want = [ref for d, r in enumerate(rows) for i, b in r["faults"][:capacity]
            for ref in layout.locate(ChunkDamage(d, i, Damage(b)))]
    assert list(report.state) == want
    assert report.grads_unlisted and [g.device for g in report.grads] == [1]
    assert report.damaged_devices.tolist() == [bool(r["faults"]) for r in rows]
    assert list(report.disagree) == [ref for i, b in rows[3]["disagree"]
                                     for ref in layout.locate(ChunkDamage(3, i, Damage(b)))]
    merged = merge([report, report])
    assert merged.chunks == tuple(sorted(set(want))) and merged.first_step == 7


def test_decode_step_reads_the_steps_kept_count_and_its_scalars_verdict(rng):
    """The step's kept count is the most any device's row holds, its scalars bad where any row
    says so, its verdict device 0's (the same on every row); zero rows read as none."""
    layout = random_layout(rng)
    kept = [int(k) for k in rng.integers(1, 10**6, size=4)]
    one = [0] * 4
    one[int(rng.integers(4))] = 1
    for row_kept, row_bad, committed, want in ((kept, [0] * 4, 1, (max(kept), False, True)),
                                               ([0] * 4, one, 0, (0, True, False)),
                                               ([0] * 4, [0] * 4, 0, (0, False, False))):
        rows = [{"committed": committed, "faults": [], "grads": [], "kept": k, "bad_scalars": b}
                for k, b in zip(row_kept, row_bad)]
        report = decode_step(3, summary_of(rows, 2), layout)
        assert (report.kept, report.bad_scalars, report.committed) == want


def test_replica_pulls_come_from_a_healthy_replica(rng):
    for shard, replicas in itertools.product((1, 2, 3), (2, 3, 4)):
        layout = random_layout(rng, shard)
        chunks = every_chunk(layout, replicas * shard)
        if not chunks:
            continue
        picked = [chunks[i] for i in rng.choice(len(chunks), min(40, len(chunks)), replace=False)]
        pulls = plan_replica_pulls(picked, layout, replicas)
        damaged_on = {}
        for ref in picked:
            key = (layout.column_of(ref.device), ref.leaf, ref.tensor, ref.chunk)
            damaged_on.setdefault(key, set()).add(layout.replica_of(ref.device))
        if any(len(rows) == replicas for rows in damaged_on.values()):
            assert pulls is None
            continue
        assert {(p.column, p.leaf, p.tensor, p.chunk) for p in pulls} == set(damaged_on)
        for p in pulls:
            bad = damaged_on[p.column, p.leaf, p.tensor, p.chunk]
            assert p.source not in bad and set(p.targets) == bad
            assert p.source == min(set(range(replicas)) - bad)


def test_batches_hold_every_chunk_once_within_capacity(rng):
    layout = random_layout(rng, shard=2)
    chunks = every_chunk(layout, 4)
    if not chunks:
        pytest.skip("an empty layout drawn")
    capacity = int(rng.integers(1, 5))
    pulls = plan_replica_pulls([c for c in chunks if c.device < 2], layout, 2)
    seen = []
    for batch in replica_batches(pulls, layout, capacity):
        assert (np.sum(batch.lists >= 0, axis=-1) <= capacity).all()
        for p, slot in batch.slots:
            at = (p.column, layout.leaf_index(p.leaf), layout.tensor_index(p.tensor), slot)
            assert batch.lists[at] == p.chunk and batch.sources[at] == p.source
            seen.append(p)
    assert sorted(seen) == sorted(pulls)
    work = local_work([ChunkDamage(d, i, Damage.MU | Damage.COPY_P)
                       for d in range(2) for i in range(int(layout.chunk_base[-1]))], layout)
    assert {w.tensor for w in work} == {"mu"}
    listed = []
    for lists, batch in local_batches(work, layout, capacity):
        assert (np.sum(lists >= 0, axis=-1) <= capacity).all()
        listed += [TensorChunk(layout.paths[li], layout.names[ti], int(lists[li, ti, r]))
                   for li, ti, r in zip(*np.nonzero(lists >= 0))]
    assert sorted(listed) == work


def test_a_rebuild_copies_each_column_from_a_clean_replica(rng):
    layout = random_layout(rng, shard=2)
    damaged = rng.random(3 * 2) < 0.4
    plan = plan_rebuild(damaged, layout, 3)
    grid = damaged.reshape(3, 2)
    if grid.all(axis=0).any():
        assert plan is None
        return
    for col in range(2):
        assert not grid[plan.sources[col], col]
    assert plan.devices(layout) == tuple(np.flatnonzero(damaged).tolist())
    pulls = rebuild_pulls(plan, layout)
    want = {(layout.column_of(d), leaf, t, c) for d in plan.devices(layout)
            for leaf, n in zip(layout.paths, layout.nchunks) for t in layout.names
            for c in range(n)}
    assert {(p.column, p.leaf, p.tensor, p.chunk) for p in pulls} == want

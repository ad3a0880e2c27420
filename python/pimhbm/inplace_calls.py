"""The in-place update's FFI calls, laid out by the handlers' own tables, and how each runs per
shard under plain ``jax.jit`` (``pimhbm.sharding``).

Per shard: a leaf sharded on its first dimension, in whole parity blocks, is updated by each
device on its own shards, its digests keyed by the chunks' indices in the whole tensor; other
leaves are updated whole on every device. The verdict's counts and the stash are the whole
call's: each device's counts are summed over the leaf's mesh axes, and the stashes of the
devices are packed into one, in device order, with whole-tensor chunk indices -- by sums over
the mesh (psum), never by a gather of the state. A redo reads that stash on every device and
redoes the rows of its own chunks.
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
from pimhbm.sharding import WHOLE, Arg, Leaf, Plan, Role, partitioned

# Why the update and its checks cannot be vmapped.
NO_VMAP = ("the update writes one optimizer state in place and decides commit-or-skip for all "
           "its leaves at once; for several models make one optimizer each (or stack them into "
           "one pytree of leaves)")
TENSORS = ("p", "master", "mu", "nu")
_INT32_MAX = np.iinfo(np.int32).max


class Stash(NamedTuple):
    """Gradients of chunks that did not commit: row k is chunk (leaf, chunk) = index[k, :2],
    index[k, 2] the FAULT_* bits of its damaged tensors."""

    rows: jax.Array  # uint32 (capacity, chunk_elems): the chunk's gradient bytes, zero-padded
    index: jax.Array  # int32 (capacity, 3); (-1, -1, 0) for unused rows


@functools.cache
def layout() -> dict:
    """A leaf's buffers of a pimhbm_adamw_inplace call by name, in order
    (csrc/update/inplace_ffi.h)."""
    return _core.inplace_layout()


class UpdateTotals(NamedTuple):
    """An update's or a redo's counts over the call, int32 (saturating): summed by the kernel,
    and over the mesh axes of the call's leaves (csrc/update/inplace.h, by these names)."""

    faulty: jax.Array  # chunks that did not commit (found damaged)
    kept: jax.Array  # elements whose new values were not finite, kept as they were
    stashed: jax.Array  # chunks offered to the stash (more than its capacity: not all fit)
    suspect: jax.Array  # of the faulty chunks, those whose parameter was damaged


def _totals(words: jax.Array) -> UpdateTotals:
    """The call's totals from its 64-bit counters (uint32 (n, 2)), by the handler's names."""
    names = tuple(layout()["total_names"])
    if names != UpdateTotals._fields:
        raise RuntimeError(f"the compiled module's update totals are {names}, this package "
                           f"reads {UpdateTotals._fields}: reinstall pimhbm")
    counts = saturated(words)
    return UpdateTotals(*(counts[i] for i in range(len(names))))


def _role(name: str, x: jax.Array, leaf: int) -> Arg:
    """How a leaf's buffer relates to its chunks; a placeholder (no master weights, no parity)
    is the same on every device."""
    if math.prod(x.shape) == 0 or name == "chunk_base":
        return WHOLE
    if name.startswith("d_") or name in ("faults", "kept", "checked"):
        return Arg(Role.CHUNKS, leaf)
    if name.startswith("q_"):
        return Arg(Role.GROUPS, leaf)
    return Arg(Role.ELEMS, leaf)


def _whole_base() -> jax.Array:
    return jnp.zeros((1,), jnp.int32)


# -- the checks before the update ---------------------------------------------------------------

class Prechecks(NamedTuple):
    """What the update checks before its first write: per leaf, int32 per chunk, 1 where p no
    longer matches its digest table and the number of gradient values whose square is not
    finite; and the call's totals of both (int32 (2,), saturating), summed by the kernel."""

    damaged: list[jax.Array]
    nonfinite: list[jax.Array]
    counts: jax.Array


def _precheck_ffi(params, tables, grads, bases, chunk_elems):
    """The maps of every leaf (damaged, nonfinite, ...) and the totals (uint32 (2, 2)); grads
    None: p's digests alone (every nonfinite map 0)."""
    args, out_types = [], []
    for i, (p, table, base) in enumerate(zip(params, tables, bases)):
        args += [p, table] + ([] if grads is None else [grads[i]]) + [base]
        out_types += [jax.ShapeDtypeStruct((table.shape[0],), jnp.int32)] * 2
    out_types.append(jax.ShapeDtypeStruct((PRECHECK_TOTALS, 2), jnp.uint32))
    return tuple(unbatched_call("pimhbm_inplace_precheck", out_types, NO_VMAP)(
        *args, chunk_elems=np.int64(chunk_elems), gradients=np.bool_(grads is not None)))


PRECHECK_TOTALS = 2  # damaged chunks, non-finite gradient values (csrc/update/precheck.h)


def prechecks(params: list[jax.Array], tables: list[jax.Array], grads: list[jax.Array] | None,
              chunk_elems: int) -> Prechecks:
    """What the update checks before its first write, in one pass over p and g (one
    pimhbm_inplace_precheck call for every leaf): per leaf, per chunk of ``chunk_elems``
    elements, whether p no longer matches its digest table (as :func:`pimhbm.verify`) and the
    number of gradient values whose float32 square is not finite (NaN, infinite, or so large
    that the second moment would overflow); and the totals of both over every leaf. Per shard
    under a mesh: the totals summed over each leaf's mesh axes, as the update's are. ``grads``
    None: p's digests alone (2 bytes a bf16 parameter), every nonfinite count 0."""
    ensure_registered()
    with_grads = grads is not None
    for i, (p, table, g) in enumerate(zip(params, tables, grads if with_grads else params,
                                          strict=True)):
        chunks = -(-p.size // chunk_elems)
        if p.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"leaf {i}: parameters must be float32 or bfloat16; got "
                             f"{p.dtype}{tuple(p.shape)}")
        if g.dtype != p.dtype or g.size != p.size:
            raise ValueError(f"leaf {i}: the gradient must have the parameters' dtype and size; "
                             f"got {p.dtype}{tuple(p.shape)} and {g.dtype}{tuple(g.shape)}")
        if table.dtype != jnp.uint32 or table.shape != (chunks, 2):
            raise ValueError(f"leaf {i}: the digest table of p must be uint32 of shape "
                             f"({chunks}, 2) for chunks of {chunk_elems} elements; got "
                             f"{table.dtype}{tuple(table.shape)}")
    n = len(params)
    if not n:
        return Prechecks([], [], jnp.zeros((PRECHECK_TOTALS,), jnp.int32))
    leaves = [Leaf(tuple(p.shape), chunk_elems) for p in params]

    per = 3 if with_grads else 2  # operands a leaf: p, its table (and its gradient)

    def whole(*flat):
        return _precheck_ffi(flat[0::per], flat[1::per], flat[2::per] if with_grads else None,
                             [_whole_base()] * n, chunk_elems)

    def lower(plan: Plan, *flat):
        maps, counts = [None] * (2 * n), jnp.zeros((PRECHECK_TOTALS,), jnp.int32)
        for axes, idx in _by_axes(plan, n).items():
            outs = _precheck_ffi([flat[per * i] for i in idx], [flat[per * i + 1] for i in idx],
                                 [flat[per * i + 2] for i in idx] if with_grads else None,
                                 [plan.chunk_base(leaves, i) for i in idx], chunk_elems)
            for j, i in enumerate(idx):
                maps[2 * i], maps[2 * i + 1] = outs[2 * j], outs[2 * j + 1]
            counts = _saturating_add(counts, _summed(saturated(outs[-1]), axes))
        return (*maps, _words(counts))

    roles = (Role.ELEMS, Role.CHUNKS, Role.ELEMS)[:per]
    operands = [Arg(role, i) for i in range(n) for role in roles]
    results = [Arg(Role.CHUNKS, i) for i in range(n) for _ in range(2)] + [WHOLE]
    op = partitioned(whole, lower, leaves, operands, results,
                     no_vmap=f"pimhbm_inplace_precheck cannot be vmapped: {NO_VMAP}")
    columns = (params, tables, grads) if with_grads else (params, tables)
    outs = op(*[x for leaf in zip(*columns) for x in leaf])
    return Prechecks(list(outs[0:-1:2]), list(outs[1:-1:2]), saturated(outs[-1]))


# -- the update and the redo ----------------------------------------------------------------------

def leaf_operands(leaf: dict, table: dict, rows: dict | None, g: jax.Array | None,
                  checked: jax.Array | None = None) -> dict:
    """A leaf's operands by the handler's names: its tensors, digest tables and parity rows,
    the gradient and the checks' map of p (what a skipped step reports), with empty
    placeholders for what it has not (master weights, parity, a redo's gradient and map), and
    chunk_base 0 (a whole tensor)."""
    p = leaf["p"]
    empty = lambda shape, dt=jnp.uint32: jnp.zeros(shape, dt)
    ops = {"p": p, "mu": leaf["mu"], "nu": leaf["nu"],
           "master": leaf.get("master", empty((0,), jnp.uint16)),
           "g": g if g is not None else empty((0,), p.dtype), "chunk_base": _whole_base(),
           "checked": checked if checked is not None else empty((0,), jnp.int32)}
    for k in TENSORS:
        ops["d_" + k] = table.get(k, empty((0, 2)))
        ops["q_" + k] = rows.get(k, empty((0, 1))) if rows is not None else empty((0, 1))
    return ops


def _result_type(ops: dict, name: str) -> jax.ShapeDtypeStruct:
    if name in ops:  # updated in place: the operand's buffer
        return jax.ShapeDtypeStruct(ops[name].shape, ops[name].dtype)
    return jax.ShapeDtypeStruct((ops["d_p"].shape[0],), jnp.int32)  # a per-chunk map


def _ffi(target: str, lead: list, leaf_ops: list[dict], attrs: dict, tail: list):
    """One call of ``target`` over ``leaf_ops``: per leaf its results by name, and the results
    after the leaves' (``tail``'s types)."""
    lay = layout()
    args, out_types, aliases = list(lead), [], {}
    for ops in leaf_ops:
        arg0, ret0 = len(args), len(out_types)
        args += [ops[name] for name in lay["operands"]]
        for j, name in enumerate(lay["results"]):
            out_types.append(_result_type(ops, name))
            if name in ops:
                aliases[arg0 + lay["operands"].index(name)] = ret0 + j
    outs = unbatched_call(target, out_types + list(tail), NO_VMAP, input_output_aliases=aliases)(
        *args, **attrs)
    per = len(lay["results"])
    results = [dict(zip(lay["results"], outs[per * i:per * (i + 1)])) for i in range(len(leaf_ops))]
    return results, list(outs[per * len(leaf_ops):])


def _leafwise(target: str, lead: list, leaf_ops: list[dict], attrs: dict, tail: list,
              per_shard) -> tuple[list[dict], list]:
    """``target`` over every leaf as one op that XLA partitions: whole where there is no mesh;
    under one, ``per_shard(plan, leaves, lead, ops, by_axes) -> (results per leaf, tail's
    outputs)`` with ``by_axes`` the leaves grouped by their mesh axes (None: whole)."""
    lay, n, k = layout(), len(leaf_ops), len(lead)
    chunk_elems, group = int(attrs["chunk_elems"]), int(attrs["group"])
    leaves = [Leaf(tuple(ops["p"].shape), chunk_elems, max(group, 1)) for ops in leaf_ops]
    per_in, per_out = len(lay["operands"]), len(lay["results"])

    def unflatten(flat):
        return list(flat[:k]), [dict(zip(lay["operands"], flat[k + per_in * i:k + per_in * (i + 1)]))
                                for i in range(n)]

    def flatten(results, rest):
        return tuple(r[name] for r in results for name in lay["results"]) + tuple(rest)

    def whole(*flat):
        lead, ops = unflatten(flat)
        return flatten(*_ffi(target, lead, ops, attrs, tail))

    def lower(plan: Plan, *flat):
        lead, ops = unflatten(flat)
        return flatten(*per_shard(plan, leaves, lead, ops, _by_axes(plan, n)))

    operands = [WHOLE] * k + [_role(name, ops[name], i) for i, ops in enumerate(leaf_ops)
                              for name in lay["operands"]]
    results = [_role(name, _result_type(ops, name), i) for i, ops in enumerate(leaf_ops)
               for name in lay["results"]] + [WHOLE] * len(tail)
    op = partitioned(whole, lower, leaves, operands, results,
                     no_vmap=f"{target} cannot be vmapped: {NO_VMAP}")
    outs = op(*lead, *[ops[name] for ops in leaf_ops for name in lay["operands"]])
    res = [dict(zip(lay["results"], outs[per_out * i:per_out * (i + 1)])) for i in range(n)]
    return res, list(outs[per_out * n:])


def _group_call(target, lead, ops, idx, bases, attrs, tail):
    """``target`` over the leaves ``idx`` of one mesh-axes group, each with its chunk base."""
    return _ffi(target, lead, [dict(ops[i], chunk_base=b) for i, b in zip(idx, bases)], attrs,
                tail)


def update_call(scalars: jax.Array, go: jax.Array, leaf_ops: list[dict], attrs: dict,
                capacity: int):
    """pimhbm_adamw_inplace over every leaf: per leaf its results by name, the stash, the
    totals; per shard under a mesh (module docstring)."""
    lay = layout()
    tail = [jax.ShapeDtypeStruct((capacity, int(attrs["chunk_elems"])), jnp.uint32),
            jax.ShapeDtypeStruct((capacity, lay["stash_columns"]), jnp.int32),
            jax.ShapeDtypeStruct((lay["totals"], 2), jnp.uint32)]

    def per_shard(plan, leaves, lead, ops, by_axes):
        results, merged = [None] * len(ops), _StashMerge(plan, tail)
        for axes, idx in by_axes.items():
            bases = [plan.chunk_base(leaves, i) for i in idx]
            part, (rows, index, totals) = _group_call("pimhbm_adamw_inplace", lead, ops, idx,
                                                      bases, attrs, tail)
            for i, r in zip(idx, part):
                results[i] = r
            merged.add(axes, Stash(rows, index), totals, jnp.asarray(idx, jnp.int32),
                       jnp.concatenate(bases))
        return results, merged.result()

    res, (rows, index, totals) = _leafwise("pimhbm_adamw_inplace", [scalars, go], leaf_ops, attrs,
                                           tail, per_shard)
    return res, Stash(rows, index), _totals(totals)


def redo_call(scalars: jax.Array, stash: Stash, leaf_ops: list[dict], attrs: dict):
    """pimhbm_adamw_redo over every leaf: per leaf its results by name, and the totals. Per
    shard under a mesh: each device redoes the stash's rows of its own chunks."""
    tail = [jax.ShapeDtypeStruct((layout()["totals"], 2), jnp.uint32)]

    def per_shard(plan, leaves, lead, ops, by_axes):
        scalars, rows, index = lead
        results, totals = [None] * len(ops), jnp.zeros((tail[0].shape[0],), jnp.int32)
        for axes, idx in by_axes.items():
            limits = [leaves[i].local_chunks(plan.shards(i)) if axes else _INT32_MAX for i in idx]
            bases = [plan.chunk_base(leaves, i) for i in idx]
            local = _local_rows(index, idx, jnp.concatenate(bases), limits, len(ops))
            part, (words,) = _group_call("pimhbm_adamw_redo", [scalars, rows, local], ops, idx,
                                         bases, attrs, tail)
            for i, r in zip(idx, part):
                results[i] = r
            totals = _saturating_add(totals, _summed(saturated(words), axes))
        return results, [_words(totals)]

    res, (totals,) = _leafwise("pimhbm_adamw_redo", [scalars, stash.rows, stash.index], leaf_ops,
                               attrs, tail, per_shard)
    return res, _totals(totals)


def _local_rows(index: jax.Array, idx: list[int], bases: jax.Array, limits: list[int],
                leaves: int) -> jax.Array:
    """A stash's index (whole-call leaf, whole-tensor chunk, bits) as one group's call reads
    it: its leaves renumbered in the group, chunks in this device's shard; every other row
    unused (-1, -1, 0)."""
    place = jnp.full((leaves,), -1, jnp.int32).at[jnp.asarray(idx)].set(
        jnp.arange(len(idx), dtype=jnp.int32))
    j = place[jnp.clip(index[:, 0], 0, leaves - 1)]
    k = jnp.clip(j, 0, len(idx) - 1)
    chunk = index[:, 1] - bases[k]
    mine = (index[:, 0] >= 0) & (j >= 0) & (chunk >= 0) & (chunk < jnp.asarray(limits)[k])
    unused = jnp.asarray([-1, -1, 0], jnp.int32)
    return jnp.where(mine[:, None], jnp.stack([j, chunk, index[:, 2]], axis=1), unused)


def _by_axes(plan: Plan, n: int) -> dict[Any, list[int]]:
    """The leaves 0..n-1 grouped by their mesh axes (None: whole), in order: one call a group."""
    groups: dict[Any, list[int]] = {}
    for i in range(n):
        groups.setdefault(plan.axes[i], []).append(i)
    return groups


def _summed(counts: jax.Array, axes) -> jax.Array:
    """A per-shard call's int32 counts summed over its leaves' mesh axes (none: whole leaves,
    the same counts on every device), saturating."""
    return counts if axes is None else saturating_psum(counts, axes)


def saturating_psum(counts: jax.Array, axis_name: Any) -> jax.Array:
    """Non-negative int32 counts summed over ``axis_name``, saturating rather than wrapping:
    a wrapped sum could read as zero, and zero is the verdict that commits."""
    return jax.lax.psum(jnp.minimum(counts, _INT32_MAX // jax.lax.axis_size(axis_name)), axis_name)


def _saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(b > _INT32_MAX - a, _INT32_MAX, a + b)


def _words(counts: jax.Array) -> jax.Array:
    """int32 counts as the ops' 64-bit counters: uint32 (..., (low, high))."""
    return jnp.stack([counts.astype(jnp.uint32), jnp.zeros_like(counts, jnp.uint32)], axis=1)


def saturated(words: jax.Array) -> jax.Array:
    """int32 from 64-bit counters as (..., (low, high)) uint32 words, saturating at INT32_MAX."""
    lo, hi = words[..., 0], words[..., 1]
    return jnp.where((hi != 0) | (lo > _INT32_MAX), _INT32_MAX, lo.astype(jnp.int32))


class _StashMerge:
    """The stashes and totals of the per-shard calls as one call's: the rows of each call in
    order, each device's after those of the devices before it on the call's mesh axes, with
    whole-call leaf numbers and whole-tensor chunk indices; counts summed (saturating)."""

    def __init__(self, plan: Plan, tail: list):
        (rows, index, _) = tail
        self.plan = plan
        self.rows = jnp.zeros(rows.shape, rows.dtype)
        self.index = jnp.zeros(index.shape, index.dtype)  # leaf + 1, chunk + 1, bits; 0: unused
        self.offset = jnp.int32(0)
        self.totals = jnp.zeros((tail[2].shape[0],), jnp.int32)

    def add(self, axes, stash: Stash, totals: jax.Array, leaf_ids: jax.Array, bases: jax.Array):
        capacity = stash.rows.shape[0]
        used = stash.index[:, 0] >= 0
        rank = jnp.cumsum(used.astype(jnp.int32)) - 1  # the row's place among this call's
        j = jnp.clip(stash.index[:, 0], 0, leaf_ids.shape[0] - 1)
        index = jnp.stack([jnp.where(used, leaf_ids[j] + 1, 0),
                           jnp.where(used, stash.index[:, 1] + bases[j] + 1, 0),
                           jnp.where(used, stash.index[:, 2], 0)], axis=1)
        count, counts = used.sum(dtype=jnp.int32), saturated(totals)
        before, total = jnp.int32(0), count
        if axes is not None:
            k = math.prod(self.plan.mesh.shape[a] for a in axes)
            me = jax.lax.axis_index(axes)
            per = jax.lax.psum(jnp.zeros((k,), jnp.int32).at[me].set(count), axes)
            before = jnp.sum(jnp.where(jnp.arange(k) < me, per, 0))
            total = per.sum()
            counts = jax.lax.psum(jnp.minimum(counts, _INT32_MAX // k), axes)
        target = jnp.where(used, self.offset + before + rank, capacity)
        rows = jnp.zeros_like(self.rows).at[target].set(stash.rows, mode="drop")
        index = jnp.zeros_like(self.index).at[target].set(index, mode="drop")
        if axes is not None:
            rows, index = jax.lax.psum(rows, axes), jax.lax.psum(index, axes)
        self.rows, self.index = self.rows | rows, self.index + index
        self.offset = self.offset + total
        self.totals = _saturating_add(self.totals, counts)

    def result(self) -> list[jax.Array]:
        return [self.rows, self.index - jnp.asarray([1, 1, 0], jnp.int32), _words(self.totals)]

"""Parity over groups of chunks: one damaged chunk of a group rebuilt in place from the others.

A tensor's bytes are cut into chunks of ``chunk_bytes`` (as its digests are) and the chunks into
groups of at most ``group`` chunks; a group's parity row is the XOR of its chunks (each
zero-padded to ``chunk_bytes``), stored as uint32 words: (groups, chunk_bytes // 4), with
ceil(chunks / group) groups. A tensor's parity costs about 1/group of its bytes.

Neighbouring chunks sit in different groups, so that a burst of damage over a few consecutive
chunks (a failed DRAM row) is rebuilt in place, one chunk from each group: chunks are taken in
blocks of group x group, and a block's chunks are dealt round-robin to its groups (``group`` of
them; ceil(n / group) in a short last block of n chunks), counted from the block's end so that
the tensor's last chunk is last in the last group. :func:`chunk_groups` gives the deal; see
csrc/parity/groups.h and parity.h.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm._ffi import ensure_registered
from pimhbm.scan import _check_chunk_bytes, _check_dtype, num_chunks
from pimhbm.repair import NOT_LISTED, OUT_OF_RANGE
from pimhbm.sharding import WHOLE, Arg, Leaf, Plan, Role, partitioned

GROUP_CONFLICT = -4  # a rebuild status beside pimhbm.repair's: two entries in one group


def num_groups(x: jax.Array, chunk_bytes: int, group: int) -> int:
    return -(-num_chunks(x, chunk_bytes) // group)


MAX_GROUP = 1 << 15  # csrc/parity/groups.h's kMaxGroup


def _check_group(group: int) -> int:
    if (isinstance(group, bool) or not isinstance(group, (int, np.integer))
            or not 1 <= group <= MAX_GROUP):
        raise ValueError(f"group must be an int from 1 to {MAX_GROUP}, got {group!r}")
    return int(group)


def chunk_groups(chunks: int, group: int, xp: Any = np) -> Any:
    """The parity group of each of a tensor's ``chunks`` chunks (int32), as the kernels deal
    them (module docstring). ``xp``: numpy, or jax.numpy inside a traced function (an iota and
    a few operations, where numpy's result would be a constant of the program)."""
    group = _check_group(group)
    c = xp.arange(chunks, dtype=xp.int32)
    block = group * group
    first = c // block * block
    n = xp.minimum(block, chunks - first)  # chunks in c's block
    groups = -(-n // group)  # groups in c's block
    return c // block * group + groups - 1 - (n - 1 - (c - first)) % groups


def parity(x: jax.Array, chunk_bytes: int, group: int) -> jax.Array:
    """The parity rows of ``x``: uint32 (groups, chunk_bytes // 4)."""
    ensure_registered()
    chunk_bytes, group = _check_chunk_bytes(chunk_bytes), _check_group(group)
    x = jnp.asarray(x)
    _check_dtype(x.dtype)

    def call(x):
        shape = (num_groups(x, chunk_bytes, group), chunk_bytes // 4)
        return (jax.ffi.ffi_call("pimhbm_parity", jax.ShapeDtypeStruct(shape, jnp.uint32),
                                 vmap_method="sequential")(
            x, chunk_bytes=np.int64(chunk_bytes), group=np.int64(group)),)

    # A shard of whole blocks has the whole tensor's rows of its groups: the XOR needs no index.
    leaves = [Leaf(tuple(x.shape), chunk_bytes // x.dtype.itemsize, group)]
    op = partitioned(call, lambda plan, x: call(x), leaves, [Arg(Role.ELEMS, 0)],
                     [Arg(Role.GROUPS, 0)])
    return op(x)[0]


def rebuild(chunks: jax.Array, x: jax.Array, table: jax.Array, rows: jax.Array,
            chunk_bytes: int, group: int) -> tuple[jax.Array, jax.Array]:
    """The listed ``chunks`` (int32, -1 = none) of ``x`` rebuilt in place from the parity
    ``rows`` and the other chunks of their groups, each checked against its digest row in
    ``table`` afterwards. Returns the new ``x`` and a status per entry: REPAIRED, STILL_DAMAGED
    (another chunk of the group or the parity is damaged too), NOT_LISTED, OUT_OF_RANGE or
    GROUP_CONFLICT (two entries of one group: neither is rebuilt)."""
    ensure_registered()
    chunk_bytes, group = _check_chunk_bytes(chunk_bytes), _check_group(group)
    chunks = jnp.asarray(chunks, jnp.int32).reshape(-1)

    def call(chunks, x, table, rows, base):
        return tuple(jax.ffi.ffi_call(
            "pimhbm_parity_rebuild",
            (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(chunks.shape, jnp.int32)),
            input_output_aliases={1: 0})(chunks, x, table, rows, base,
                                         chunk_bytes=np.int64(chunk_bytes), group=np.int64(group)))

    leaves = [Leaf(tuple(x.shape), chunk_bytes // x.dtype.itemsize, group)]

    def lower(plan: Plan, chunks, x, table, rows):
        """This device's entries of the list, in its own chunks; every entry's status is its
        owner's (a group never straddles two shards, so conflicts are found by their owner)."""
        base = plan.chunk_base(leaves, 0)
        if plan.axes[0] is None:
            return call(chunks, x, table, rows, base)
        local = chunks - base[0]
        mine = (chunks >= 0) & (local >= 0) & (local < table.shape[0])
        x, status = call(jnp.where(mine, local, -1), x, table, rows, base)
        owned = jax.lax.psum(jnp.where(mine, status, 0), plan.axes[0])
        total = math.prod(x.shape) * plan.shards(0) // leaves[0].chunk_elems
        return x, jnp.where(chunks < 0, NOT_LISTED, jnp.where(chunks >= total, OUT_OF_RANGE, owned))

    op = partitioned(lambda *a: call(*a, jnp.zeros((1,), jnp.int32)), lower, leaves,
                     [WHOLE, Arg(Role.ELEMS, 0), Arg(Role.CHUNKS, 0), Arg(Role.GROUPS, 0)],
                     [Arg(Role.ELEMS, 0), WHOLE],
                     no_vmap="pimhbm_parity_rebuild cannot be vmapped: it rebuilds one tensor in place")
    return op(chunks, x, table, rows)

"""Sharding rules of the chunked FFI ops: under plain ``jax.jit``, with inputs sharded on their
first dimension (``NamedSharding(mesh, P(axes, None, ...))``), each device runs the op on its
own shards -- no all-gather of the state -- and the outputs keep the inputs' sharding.

A leaf's chunks are cut from its whole tensor (row-major), so a shard whose rows hold a whole
number of chunks (and of parity blocks, group x group chunks, where the op keeps parity: a run
of whole blocks holds a run of whole groups, pimhbm.parity) is a contiguous run of them:
its device computes their digests with the chunks' indices in the whole tensor (the
``chunk_base`` operand of the ops), and every result equals the unsharded op's bit for bit.
A leaf whose shards do not fall on those boundaries, or that is sharded on another dimension,
is gathered and computed whole (correct, not per shard). Without a mesh, and inside
``shard_map`` (each device's view already local), the op runs as it is.

Each op names the role of every operand and result (``Role``); ``partitioned`` turns that into
a Shardy rule (the leaf's first dimension and its chunk and group tables share a factor) and a
partition callback that picks, per leaf, its mesh axes or none, and builds the per-shard call.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


class Role(enum.Enum):
    ELEMS = "elems"  # an array of the leaf's shape (p, mu, nu, master, g)
    CHUNKS = "chunks"  # first dimension: the leaf's chunks (digest tables, per-chunk maps)
    GROUPS = "groups"  # first dimension: the leaf's parity groups
    WHOLE = "whole"  # not a leaf's, or a placeholder: every device gets all of it


class Arg(NamedTuple):
    """One operand or result: its role and (roles ELEMS, CHUNKS, GROUPS) its leaf."""

    role: Role
    leaf: int = -1


WHOLE = Arg(Role.WHOLE)


class Leaf(NamedTuple):
    """What the rules need of a leaf: its shape, its chunk, and its parity group (chunks a
    group holds; 1 where the op keeps no parity)."""

    shape: tuple[int, ...]
    chunk_elems: int
    group: int = 1

    @property
    def unit_chunks(self) -> int:
        """Chunks a shard must hold a multiple of: a parity block (pimhbm.parity)."""
        return self.group * self.group

    @property
    def rows_per_unit(self) -> int:
        """Rows of the smallest run of whole units (unit_chunks chunks) that starts a row."""
        row = math.prod(self.shape[1:])
        unit = self.chunk_elems * self.unit_chunks
        return unit // math.gcd(unit, row) if row else 0

    @property
    def units(self) -> int:
        """Such runs in the leaf (0: the leaf cannot be cut on unit boundaries at all)."""
        rows = self.rows_per_unit
        if not self.shape or rows == 0 or self.shape[0] % rows:
            return 0
        return self.shape[0] // rows

    def shardable(self, shards: int) -> bool:
        return self.units > 0 and self.units % shards == 0

    def local_chunks(self, shards: int) -> int:
        return math.prod(self.shape) // shards // self.chunk_elems


class Plan(NamedTuple):
    """How one call runs on each device: per leaf its mesh axes (None: whole on every device)."""

    axes: tuple[tuple[str, ...] | None, ...]
    mesh: Any

    def shards(self, leaf: int) -> int:
        axes = self.axes[leaf]
        return 1 if axes is None else math.prod(self.mesh.shape[a] for a in axes)

    def spec(self, arg: Arg, ndim: int) -> PartitionSpec:
        axes = None if arg.role is Role.WHOLE else self.axes[arg.leaf]
        if axes is None or ndim == 0:
            return PartitionSpec()
        return PartitionSpec(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1)))

    def chunk_base(self, leaves: Sequence[Leaf], leaf: int) -> jax.Array:
        """int32 (1,): the index in the whole tensor of this device's first chunk of ``leaf``
        (inside the per-shard program, where the mesh axes are bound)."""
        axes = self.axes[leaf]
        if axes is None:
            return jnp.zeros((1,), jnp.int32)
        local = leaves[leaf].local_chunks(self.shards(leaf))
        return (jax.lax.axis_index(axes) * local).astype(jnp.int32).reshape(1)


# lower(plan, *local_operands) -> local results: the op on this device's shards.
Lower = Callable[..., Any]


def _first_axes(sharding: Any, ndim: int) -> tuple[str, ...] | None:
    """The mesh axes of a sharding on the first dimension only; None for anything else."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    if ndim == 0 or spec[0] is None or any(s is not None for s in spec[1:]):
        return None
    return spec[0] if isinstance(spec[0], tuple) else (spec[0],)


def _plan(mesh, leaves: Sequence[Leaf], operands: Sequence[Arg], arg_shapes) -> Plan:
    """Per leaf, the axes of its first ELEMS operand where its shards fall on unit boundaries."""
    axes: list[tuple[str, ...] | None] = [None] * len(leaves)
    seen = set()
    for arg, shape in zip(operands, arg_shapes):
        if arg.role is not Role.ELEMS or arg.leaf in seen:
            continue
        seen.add(arg.leaf)
        found = _first_axes(shape.sharding, len(shape.shape))
        if found is not None and leaves[arg.leaf].shardable(
                math.prod(mesh.shape[a] for a in found)):
            axes[arg.leaf] = found
    return Plan(tuple(axes), mesh)


class _Rule:
    """Shardy's rule, written factor by factor: a leaf's first dimension, its chunk tables and
    its parity rows share the factor ``l<i>`` (the leaf's units); every other dimension gets a
    factor of its own, which must stay replicated."""

    def __init__(self, leaves: Sequence[Leaf]):
        self.leaves = leaves
        self.sizes: dict[str, int] = {}
        self.replicated: list[str] = []
        self.whole: set[str] = set()

    def _own(self) -> str:
        name = f"z{len(self.sizes)}"
        self.sizes[name] = -1  # a lone factor: its size comes from its dimension
        self.replicated.append(name)
        return name

    def dims(self, arg: Arg, shape: Sequence[int]) -> str:
        leaf = self.leaves[arg.leaf] if arg.role is not Role.WHOLE else None
        if leaf is None or not shape or leaf.units < 2 or shape[0] == 0:
            return " ".join(self._own() for _ in shape)
        elems = leaf.rows_per_unit * math.prod(leaf.shape[1:])  # of one run of units
        per_unit = {Role.ELEMS: leaf.rows_per_unit,
                    Role.CHUNKS: elems // leaf.chunk_elems,
                    Role.GROUPS: elems // (leaf.chunk_elems * leaf.group)}[arg.role]
        factor = f"l{arg.leaf}"
        self.sizes[factor] = leaf.units
        first = factor
        if per_unit == 1:
            self.whole.add(factor)  # Shardy takes its size from this dimension
        else:
            inner = f"u{len(self.sizes)}"
            self.sizes[inner] = per_unit
            first = f"({factor} {inner})"
        return " ".join([first] + [self._own() for _ in shape[1:]])

    def text(self, operands, results, value_types, result_types) -> tuple[str, dict]:
        ins = ", ".join(self.dims(a, t.shape) for a, t in zip(operands, value_types))
        outs = ", ".join(self.dims(a, t.shape) for a, t in zip(results, result_types))
        sizes = {k: v for k, v in self.sizes.items() if v > 0 and k not in self.whole}
        return f"{ins} -> {outs}", dict(need_replication_factors=tuple(self.replicated), **sizes)


def partitioned(whole: Callable[..., Any], lower: Lower, leaves: Sequence[Leaf],
                operands: Sequence[Arg], results: Sequence[Arg], *,
                no_vmap: str | None = None) -> Callable[..., Any]:
    """``whole(*operands) -> results`` (a tuple) as an op that XLA partitions by ``lower``.
    Under ``jax.vmap`` it runs ``whole`` for each member of the batch, or, with ``no_vmap``,
    raises a ValueError that says why it cannot."""
    op = custom_partitioning(whole)

    def rule(mesh, value_types, result_types):
        return _Rule(leaves).text(operands, results, value_types, result_types)

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(mesh, leaves, operands, arg_shapes)
        result_shapes = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        arg_sh = tuple(NamedSharding(mesh, plan.spec(a, len(s.shape)))
                       for a, s in zip(operands, arg_shapes))
        res_sh = tuple(NamedSharding(mesh, plan.spec(a, len(s.shape)))
                       for a, s in zip(results, result_shapes))
        return mesh, lambda *xs: lower(plan, *xs), res_sh, arg_sh

    op.def_partition(partition=partition, sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def call(*xs):
        return op(*xs)

    @call.def_vmap
    def batched(axis_size, in_batched, *xs):
        if no_vmap is not None:
            raise ValueError(no_vmap)
        outs = jax.vmap(whole, in_axes=tuple(0 if b else None for b in in_batched))(*xs)
        return outs, tuple(True for _ in outs)

    return call

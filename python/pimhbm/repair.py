"""Chunk-level repair in place, and the snapshot op (device or host buffers -> shared memory)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm._ffi import ensure_registered

# Status of each listed chunk (csrc/repair/repair.h).
NOT_LISTED, REPAIRED, SOURCE_DAMAGED, STILL_DAMAGED, OUT_OF_RANGE = 0, 1, -1, -2, -3


def repair(chunks: jax.Array, src: tuple[jax.Array, jax.Array], dst: tuple[jax.Array, jax.Array],
           chunk_bytes: int) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Rewrites the listed ``chunks`` (int32, -1 = none) of ``dst`` = (tensor, digest table)
    from ``src`` = (tensor, table), in place. Each source chunk is checked against its digest
    first (a damaged source is never copied), each target chunk after. Returns the new
    (tensor, table) and a status per listed chunk (REPAIRED, SOURCE_DAMAGED, ...)."""
    ensure_registered()
    (t, table), (s, s_table) = dst, src
    if s.shape != t.shape or s.dtype != t.dtype:
        raise ValueError(f"source {s.dtype}{tuple(s.shape)} does not match target "
                         f"{t.dtype}{tuple(t.shape)}")
    outs = jax.ffi.ffi_call(
        "pimhbm_repair",
        [jax.ShapeDtypeStruct(t.shape, t.dtype), jax.ShapeDtypeStruct(table.shape, table.dtype),
         jax.ShapeDtypeStruct(chunks.shape, jnp.int32)],
        input_output_aliases={3: 0, 4: 1})(
            chunks.astype(jnp.int32), s, s_table, t, table, chunk_bytes=np.int64(chunk_bytes))
    return (outs[0], outs[1]), outs[2]


def repair_packed(chunks: jax.Array, rows: tuple[jax.Array, jax.Array],
                  dst: tuple[jax.Array, jax.Array], chunk_bytes: int
                  ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Like :func:`repair`, from chunks packed by entry: ``rows`` = (data holding chunk k of
    the list at row k, chunk_bytes each, in dst's dtype; their digest rows (k, 2)) -- chunks
    received from another device, each checked against the digest that came with it before it
    is written. Work and memory in proportion to the list, not to the tensor."""
    ensure_registered()
    (t, table), (data, data_table) = dst, rows
    k = chunks.shape[0] if chunks.ndim else 1
    if data.dtype != t.dtype or data.size * data.dtype.itemsize != k * chunk_bytes:
        raise ValueError(f"received rows {data.dtype}{tuple(data.shape)} must hold {k} chunks of "
                         f"{chunk_bytes} bytes of {t.dtype}")
    outs = jax.ffi.ffi_call(
        "pimhbm_repair_packed",
        [jax.ShapeDtypeStruct(t.shape, t.dtype), jax.ShapeDtypeStruct(table.shape, table.dtype),
         jax.ShapeDtypeStruct(chunks.shape, jnp.int32)],
        input_output_aliases={3: 0, 4: 1})(
            chunks.astype(jnp.int32), data, data_table, t, table,
            chunk_bytes=np.int64(chunk_bytes))
    return (outs[0], outs[1]), outs[2]


def backup_snapshot(tensors: list[jax.Array], region: Any, offsets: list[int]) -> jax.Array:
    """Copies ``tensors`` into the shared-memory ``region`` at ``offsets`` (on the GPU on a side
    stream, after everything before it on XLA's stream). Returns a ticket (int32[1]) that is
    ready once the copies were issued; ``pimhbm._core.snapshot_wait()`` waits for them.

    The program names the region by its id: once the region is gone, running it again is an
    error (not a write through a stale address)."""
    ensure_registered()
    if len(tensors) != len(offsets):
        raise ValueError(f"{len(tensors)} tensors but {len(offsets)} offsets")
    return jax.ffi.ffi_call("pimhbm_snapshot", jax.ShapeDtypeStruct((1,), jnp.int32),
                            has_side_effect=True)(
        *tensors, region=np.int64(region.id),
        offsets=np.asarray(offsets, np.int64))


def snapshot_fence(tree: Any) -> Any:
    """``tree`` unchanged (its arrays aliased), available to what reads it only once the
    snapshot copies issued before it (:func:`backup_snapshot`) are done: a state updated in
    place fences its update's inputs, so that a copy never reads a half-written state. On the
    CPU the copies are done inside the snapshot op: nothing waits.

    It is not marked as having a side effect: its results are used (nothing can drop it), and
    a program with a side-effecting op leaves JAX's C++ dispatch for its Python path (several
    milliseconds a call for a training step's hundreds of arrays)."""
    ensure_registered()
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    out = jax.ffi.ffi_call("pimhbm_snapshot_fence",
                           [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                           input_output_aliases={i: i for i in range(len(leaves))})(*leaves)
    return jax.tree.unflatten(treedef, out)

"""Chunks travel from a healthy replica through XLA's collectives (transport 1).

Inside ``shard_map`` over the replica axis: the source device's chunks go to every device in
one psum of their raw bits (integers: exact, where a float sum would turn -0.0 into +0.0)
together with their digest rows; each receiving device then writes them through the packed
repair op, which checks each received chunk against the received digest first and its own
chunk after. Work and memory go with the number of listed chunks, not the tensor's size.
A fixed capacity of listed chunks per tensor keeps the program's shapes fixed: a repair needs
no new program and no new communicator. The other transport, a direct read of the peer's memory,
is :func:`pimhbm.peer.pull`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pimhbm.repair import repair_packed

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])


def pull_collective(chunks: jax.Array, sources: jax.Array, dst: tuple[jax.Array, jax.Array],
                    chunk_bytes: int, axis_name: str):
    """Like :func:`pimhbm.peer.pull`: the listed ``chunks`` (-1 = none) of ``dst`` = (tensor,
    digest table) rewritten from the copy on device ``sources[k]`` along ``axis_name``."""
    me = jax.lax.axis_index(axis_name)
    t, table = dst
    ce = chunk_bytes // t.dtype.itemsize
    nch = table.shape[0]
    valid = chunks >= 0
    take = jnp.clip(chunks, 0, nch - 1)
    # The listed chunks' elements, gathered from the flat tensor (past its end: zeros).
    flat = t.reshape(-1)
    at = take[:, None] * ce + jnp.arange(ce)[None, :]
    rows = jnp.take(flat, at, mode="fill", fill_value=0)
    mine = (valid & (sources == me))[:, None]
    sent = jnp.where(mine, as_bits(rows), 0)
    sent_rows = jnp.where(mine, table[take], 0)
    got = jax.lax.bitcast_convert_type(jax.lax.psum(sent, axis_name), t.dtype)
    got_rows = jax.lax.psum(sent_rows, axis_name)
    targets = jnp.where(valid & (sources != me), chunks, -1)
    return repair_packed(targets, (got, got_rows), (t, table), chunk_bytes)


def copy_whole(x: jax.Array, source: jax.Array, take: jax.Array, axis_name: str) -> jax.Array:
    """``x`` from device ``source`` where ``take`` (this device's flag), else this device's own
    ``x``: one psum of the raw bits."""
    me = jax.lax.axis_index(axis_name)
    sent = jnp.where(me == source, as_bits(x), 0)
    got = jax.lax.bitcast_convert_type(jax.lax.psum(sent, axis_name), x.dtype)
    return jnp.where(take, got, x)

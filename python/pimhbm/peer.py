"""Peer-pointer collectives and the one-sided chunk pull, for the devices of one process.

Inside ``jax.shard_map`` over ``mesh``, each device's handler meets its peers along
``axis_name`` on the host, learns where their buffers are, and reads them directly: on GPUs one
kernel over peer memory (NVLink/PCIe peer access, no NCCL call, no multicast), ordered by CUDA
events so that no device waits for the host; on the CPU plain copies (the reference, and what
CI runs). Every wait is bounded by ``timeout_ms``: a peer that does not arrive gives an error
naming the missing ranks, never a hang.

- ``all_gather(x, axis_name, mesh)``  -> (n, *x.shape), like ``jax.lax.all_gather``
- ``all_to_all(x, axis_name, mesh)``  -> x's shape, block p from peer p, like
  ``jax.lax.all_to_all(x, axis_name, 0, 0)``
- ``pull(chunks, sources, (x, table), ...)``: listed chunks rewritten from the same chunk of
  another device's copy (``sources`` = its index along the axis), each checked against the
  peer's digest before the copy and against its own after (the repair op's statuses)

The devices of a group must all belong to this process (one process seeing its GPUs).

Several peer ops in one program must meet their peers in the same order on every device. On
GPUs each device runs its program's ops in order; XLA's CPU runtime runs them in any order its
buffers allow (an optimization barrier orders nothing there). So each op takes ``after=``: an
array written by the op that must come first (its result; a pull's status), passed as an
operand the op does not read -- a read the runtime orders behind that write."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm._ffi import ensure_registered

DEFAULT_TIMEOUT_MS = 20_000
MAX_GROUP = 8
_tags = itertools.count(1)


def device_ordinal(device: jax.Device) -> int:
    """What XLA's FFI reports as the device ordinal of ``device`` in this process."""
    if device.process_index != jax.process_index():
        raise ValueError(f"{device} belongs to process {device.process_index}: peer ops need every "
                         "device of a group in this process")
    # The ordinal within this process (CUDA's on GPUs; the local index on the host platform,
    # which differs from device.id in every process but the first).
    hw = device.local_hardware_id
    return int(hw if hw is not None else device.id)


def groups(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """The device ordinals of every group along ``axis_name`` (rows, in axis order)."""
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis {axis_name!r} is not one of the mesh's axes {mesh.axis_names}")
    axis = mesh.axis_names.index(axis_name)
    devices = np.moveaxis(mesh.devices, axis, -1)
    size = devices.shape[-1]
    if size > MAX_GROUP:
        raise ValueError(f"axis {axis_name!r} has {size} devices; peer ops take at most {MAX_GROUP}")
    return np.vectorize(device_ordinal, otypes=[np.int64])(devices).reshape(-1, size)


def _ordering(after: jax.Array | None) -> tuple:
    """The operand that orders an op behind ``after``'s writer (read by nobody)."""
    return () if after is None else (after,)


def _attrs(mesh, axis_name, timeout_ms) -> dict:
    table = groups(mesh, axis_name)
    if timeout_ms <= 0:
        raise ValueError("timeout_ms must be positive")
    return dict(tag=np.int64(next(_tags)), ordinals=table.reshape(-1),
                group_size=np.int64(table.shape[1]), timeout_ms=np.int64(timeout_ms))


def all_gather(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh, *,
               after: jax.Array | None = None,
               timeout_ms: int = DEFAULT_TIMEOUT_MS) -> jax.Array:
    """Every peer's ``x`` stacked in axis order: shape (n, *x.shape). ``after``: see the
    module's docstring."""
    ensure_registered()
    attrs = _attrs(mesh, axis_name, timeout_ms)
    n = int(attrs["group_size"])
    return jax.ffi.ffi_call("pimhbm_peer_all_gather",
                            jax.ShapeDtypeStruct((n, *x.shape), x.dtype))(
                                x, *_ordering(after), **attrs)


def all_to_all(x: jax.Array, axis_name: str, mesh: jax.sharding.Mesh, *,
               after: jax.Array | None = None,
               timeout_ms: int = DEFAULT_TIMEOUT_MS) -> jax.Array:
    """``x`` of shape (n, ...): block p of the result is block (my index) of peer p's ``x``.
    ``after``: see the module's docstring."""
    ensure_registered()
    attrs = _attrs(mesh, axis_name, timeout_ms)
    n = int(attrs["group_size"])
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(f"all_to_all needs one block per peer: first dimension {n}, got shape "
                         f"{tuple(x.shape)}")
    return jax.ffi.ffi_call("pimhbm_peer_all_to_all",
                            jax.ShapeDtypeStruct(x.shape, x.dtype))(x, *_ordering(after), **attrs)


def pull(chunks: jax.Array, sources: jax.Array, dst: tuple[jax.Array, jax.Array],
         chunk_bytes: int, axis_name: str, mesh: jax.sharding.Mesh, *,
         after: jax.Array | None = None,
         timeout_ms: int = DEFAULT_TIMEOUT_MS) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Rewrites the listed ``chunks`` (int32, -1 = none) of ``dst`` = (tensor, digest table) in
    place from the copy on peer ``sources[k]`` (int32, index along ``axis_name``; entries whose
    source is this device are not its to repair: NOT_LISTED). Returns the new (tensor, table)
    and a status per entry (pimhbm.REPAIRED, SOURCE_DAMAGED, ...).

    ``after``: see the module's docstring (a pull's status is what the next pull takes)."""
    ensure_registered()
    t, table = dst
    if chunks.shape != sources.shape:
        raise ValueError(f"chunks {tuple(chunks.shape)} and sources {tuple(sources.shape)} differ")
    attrs = _attrs(mesh, axis_name, timeout_ms)
    outs = jax.ffi.ffi_call(
        "pimhbm_peer_pull",
        [jax.ShapeDtypeStruct(t.shape, t.dtype), jax.ShapeDtypeStruct(table.shape, table.dtype),
         jax.ShapeDtypeStruct(chunks.shape, jnp.int32)],
        input_output_aliases={2: 0, 3: 1})(
            chunks.astype(jnp.int32), sources.astype(jnp.int32), t, table, *_ordering(after),
            chunk_bytes=np.int64(chunk_bytes), **attrs)
    return (outs[0], outs[1]), outs[2]

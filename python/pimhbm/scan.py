"""The integrity scan: per-chunk digests, non-finite counts and max |x| of tensors and pytrees.

A tensor's raw bytes (row-major) are cut into chunks of ``chunk_bytes`` (a positive multiple of
16; the last chunk may be short). For each chunk the scan computes a 64-bit digest (stored as two
uint32 words, so JAX needs no 64-bit mode), the number of NaN/Inf elements, and the largest |x|
over its finite elements. ``verify`` recomputes the digests and reports which chunks changed.

The digest detects every single-bit flip and every change confined to one 32-bit word, always;
swapped or misplaced words; and random multi-word damage with probability 1 - 2^-32 or better.
It is bit-identical on CPU and GPU.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import _core
from pimhbm._ffi import ensure_registered
from pimhbm.sharding import Arg, Leaf, Role, partitioned

DEFAULT_CHUNK_BYTES: int = int(_core.default_chunk_bytes)
_CHUNK_ALIGN: int = int(_core.chunk_align)
# The digest distinguishes the words of a chunk of up to this many bytes (digest.h).
MAX_CHUNK_SIZE: int = int(_core.max_chunk_size)

# Dtypes whose bytes we protect. Floats also get a finite check and max |x|.
_FLOAT_DTYPES = {
    np.dtype(jnp.float64),
    np.dtype(jnp.float32),
    np.dtype(jnp.float16),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e5m2),
}
_RAW_DTYPES = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64,
                                     np.uint8, np.uint16, np.uint32, np.uint64)}


class ScanResult(NamedTuple):
    """Per-chunk scan of one tensor (arrays of n = num_chunks(...) rows)."""

    digests: jax.Array  # uint32 (n, 2): low and high word of each chunk's digest
    nonfinite: jax.Array  # int32 (n,): NaN/Inf elements per chunk (0 for integer dtypes)
    max_abs: jax.Array | None  # float32 (n,): largest finite |x| per chunk; None for integers


def _check_chunk_bytes(chunk_bytes: Any) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, (int, np.integer)):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    chunk_bytes = int(chunk_bytes)
    if chunk_bytes <= 0 or chunk_bytes % _CHUNK_ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {_CHUNK_ALIGN}, "
                         f"got {chunk_bytes}")
    if chunk_bytes > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_bytes must be at most {MAX_CHUNK_SIZE}, got {chunk_bytes}")
    return chunk_bytes


def _check_dtype(dtype: Any, what: str = "x") -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _FLOAT_DTYPES and dtype not in _RAW_DTYPES:
        supported = ", ".join(sorted(str(d) for d in _FLOAT_DTYPES | _RAW_DTYPES))
        raise TypeError(f"{what} has dtype {dtype}, which pimhbm does not protect "
                        f"(supported: {supported})")
    return dtype


def num_chunks(x_or_nbytes: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Number of chunks of a tensor (or of a byte count): 0 for an empty tensor."""
    chunk_bytes = _check_chunk_bytes(chunk_bytes)
    if isinstance(x_or_nbytes, (int, np.integer)):
        nbytes = int(x_or_nbytes)
    else:
        nbytes = int(np.prod(x_or_nbytes.shape)) * np.dtype(x_or_nbytes.dtype).itemsize
    return -(-nbytes // chunk_bytes)


def scan(x: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ScanResult:
    """Per-chunk digests, non-finite counts and max |x| of ``x``; works inside ``jax.jit``."""
    ensure_registered()
    chunk_bytes = _check_chunk_bytes(chunk_bytes)
    x = jnp.asarray(x)
    dtype = _check_dtype(x.dtype)
    chunk = chunk_bytes // dtype.itemsize

    def call(x, base):
        n = num_chunks(x, chunk_bytes)
        return tuple(jax.ffi.ffi_call(
            "pimhbm_scan",
            (jax.ShapeDtypeStruct((n, 2), jnp.uint32),
             jax.ShapeDtypeStruct((n,), jnp.int32),
             jax.ShapeDtypeStruct((n,), jnp.float32)),
            vmap_method="sequential",  # one call per tensor of a batch: each its own chunks
        )(x, base, chunk_bytes=np.int64(chunk_bytes)))

    leaves = [Leaf(tuple(x.shape), chunk)]
    op = partitioned(lambda x: call(x, _whole_base()),
                     lambda plan, x: call(x, plan.chunk_base(leaves, 0)), leaves,
                     [Arg(Role.ELEMS, 0)], [Arg(Role.CHUNKS, 0)] * 3)
    digests, nonfinite, max_abs = op(x)
    return ScanResult(digests, nonfinite, max_abs if dtype in _FLOAT_DTYPES else None)


def _whole_base() -> jax.Array:
    """chunk_base of a whole tensor: its chunk 0 is its chunk 0."""
    return jnp.zeros((1,), jnp.int32)


def _digest_table(digests: Any) -> Any:
    return digests.digests if isinstance(digests, ScanResult) else digests


def verify(x: Any, digests: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> jax.Array:
    """Which chunks of ``x`` no longer match ``digests`` (a table from ``scan``): bool (n,)."""
    ensure_registered()
    chunk_bytes = _check_chunk_bytes(chunk_bytes)
    x = jnp.asarray(x)
    _check_dtype(x.dtype)
    table = jnp.asarray(_digest_table(digests))
    n = num_chunks(x, chunk_bytes)
    if table.dtype != jnp.uint32 or table.shape != (n, 2):
        raise ValueError(
            f"digest table must be uint32 of shape ({n}, 2) for a tensor of {x.dtype} "
            f"{tuple(x.shape)} in chunks of {chunk_bytes} bytes; got {table.dtype} "
            f"{tuple(table.shape)} (was it made with another chunk_bytes or tensor?)")
    def call(x, table, base):
        return (jax.ffi.ffi_call("pimhbm_verify", jax.ShapeDtypeStruct((table.shape[0],), jnp.bool_),
                                 vmap_method="sequential")(x, table, base,
                                                           chunk_bytes=np.int64(chunk_bytes)),)

    leaves = [Leaf(tuple(x.shape), chunk_bytes // x.dtype.itemsize)]
    op = partitioned(lambda x, t: call(x, t, _whole_base()),
                     lambda plan, x, t: call(x, t, plan.chunk_base(leaves, 0)), leaves,
                     [Arg(Role.ELEMS, 0), Arg(Role.CHUNKS, 0)], [Arg(Role.CHUNKS, 0)])
    return op(x, table)[0]


def scan_tree(tree: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Any:
    """``scan`` of every leaf: a pytree of the same structure with a ScanResult per leaf."""
    return jax.tree.map(lambda x: scan(x, chunk_bytes), tree)


def verify_tree(tree: Any, digests: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Any:
    """``verify`` of every leaf against a pytree of ScanResults (or of digest tables)."""
    if jax.tree.structure(tree) != jax.tree.structure(
            digests, is_leaf=lambda d: isinstance(d, ScanResult) or hasattr(d, "shape")):
        raise ValueError("digests must have the structure of the tree: "
                         f"{jax.tree.structure(tree)}")
    # Each leaf of `tree` meets the matching ScanResult (or table) of `digests`.
    return jax.tree.map(lambda x, d: verify(x, d, chunk_bytes), tree, digests)

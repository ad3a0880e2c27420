"""Fault injection: deterministic damage to real tensors, in place.

Every injection goes through one FFI op (``pimhbm_inject``) whose fault description is data (an
int32[8] spec), so one compiled program per tensor shape injects any fault: a campaign of
hundreds of faults compiles nothing after :func:`prewarm`. The input is donated and the op
writes in place on the device (or host) buffer.

Kinds: a flipped bit, a byte range overwritten with random bytes (a failed HBM row), NaN/Inf
written into one element, the whole buffer overwritten (a lost shard).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm._ffi import ensure_registered

NONE, FLIP_BIT, OVERWRITE, NONFINITE, WIPE = 0, 1, 2, 3, 4
_VALUES = {"nan": 0, "inf": 1, "-inf": 2}


def spec(kind: int = NONE, offset: int = 0, length: int = 0, bit: int = 0, seed: int = 0,
         value: str = "nan") -> np.ndarray:
    """The int32[8] description of one fault (see csrc/faults/inject.h)."""
    return np.array([kind, offset & 0xFFFFFFFF, offset >> 32, length, bit, seed & 0x7FFFFFFF,
                     _VALUES[value], 0], dtype=np.uint32).view(np.int32)


class GradientFault(NamedTuple):
    """A fault the recovery engine's step writes into one gradient leaf (its campaign hook):
    ``spec`` (:func:`spec`) applied to leaf ``leaf`` (tree order) -- after the reduction over
    the devices, on every device (``device`` None: what every replica then sees), or before
    it, on one device's own gradients only (``device``: its position in the mesh)."""

    leaf: int
    spec: np.ndarray
    device: int | None = None

    WIDTH = 10  # the encoded form's length

    def encode(self) -> np.ndarray:
        """int32[10] for the step program: leaf, device (-1: after the reduction), spec."""
        where = -1 if self.device is None else self.device
        return np.concatenate([[self.leaf, where], np.asarray(self.spec, np.int32)]).astype(
            np.int32)


NO_GRADIENT_FAULT = np.array([-1, -1] + [NONE] * 8, np.int32)


def _inject(x: jax.Array, fault: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call("pimhbm_inject", jax.ShapeDtypeStruct(x.shape, x.dtype),
                            input_output_aliases={0: 0})(x, fault)


_inject_jit = jax.jit(_inject, donate_argnums=0)
# Compiled injection programs by (shape, dtype, device): ahead-of-time compiled programs are
# kept and called directly (calling the jitted function would compile again).
_compiled: dict[tuple, Any] = {}


def _program(shape, dtype, device=None):
    key = (tuple(shape), jnp.dtype(dtype), device)
    if key not in _compiled:
        sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
        _compiled[key] = _inject_jit.lower(
            jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
            jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)).compile()
    return _compiled[key]


def inject(x: jax.Array, fault: np.ndarray) -> jax.Array:
    """``x`` with ``fault`` (a :func:`spec`) applied in place; ``x`` is donated."""
    ensure_registered()
    device = next(iter(x.devices())) if hasattr(x, "devices") else None
    fault = jax.device_put(np.asarray(fault, np.int32), device)
    return _program(x.shape, x.dtype, device)(x, fault)


def inject_in_graph(x: jax.Array, fault: jax.Array) -> jax.Array:
    """The same, for use inside a traced function (e.g. on gradients inside a train step)."""
    ensure_registered()
    return _inject(x, fault)


def _check_index(x, index: int, bit: int | None = None) -> None:
    if not 0 <= index < x.size:
        raise IndexError(f"element {index} is outside a tensor of {x.size} elements")
    bits = 8 * jnp.dtype(x.dtype).itemsize
    if bit is not None and not 0 <= bit < bits:
        raise ValueError(f"bit {bit} is outside a {bits}-bit {x.dtype} element")


def flip_bit(x: jax.Array, index: int, bit: int) -> jax.Array:
    """Bit ``bit`` of flat element ``index`` flipped (little-endian), in place."""
    x = jnp.asarray(x)
    _check_index(x, index, bit)
    byte = index * jnp.dtype(x.dtype).itemsize + bit // 8
    return inject(x, spec(FLIP_BIT, offset=byte, bit=bit % 8))


def overwrite(x: jax.Array, byte_offset: int, length: int, seed: int) -> jax.Array:
    """``length`` bytes from ``byte_offset`` replaced by random bytes of ``seed``, in place."""
    x = jnp.asarray(x)
    if not (0 <= byte_offset and length > 0 and byte_offset + length <= x.nbytes):
        raise ValueError(f"bytes [{byte_offset}, {byte_offset + length}) are outside a tensor of "
                         f"{x.nbytes} bytes")
    return inject(x, spec(OVERWRITE, offset=byte_offset, length=length, seed=seed))


def set_nonfinite(x: jax.Array, index: int, value: str = "nan") -> jax.Array:
    """Element ``index`` set to NaN, +Inf ("inf") or -Inf ("-inf"), in place."""
    x = jnp.asarray(x)
    _check_index(x, index)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"NaN/Inf can be written into float32/bfloat16/float16, not {x.dtype}")
    if value not in _VALUES:
        raise ValueError(f"value must be one of {sorted(_VALUES)}, got {value!r}")
    return inject(x, spec(NONFINITE, offset=index, value=value))


def wipe(x: jax.Array, seed: int) -> jax.Array:
    """Every byte replaced by random bytes of ``seed`` (a lost shard), in place."""
    return inject(jnp.asarray(x), spec(WIPE, seed=seed))


def prewarm(shapes: Any, device: Any = None) -> int:
    """Compiles the injection program for every (shape, dtype) in ``shapes`` (arrays or
    ShapeDtypeStructs) on ``device`` (default: JAX's default device); returns how many
    distinct programs there are. Touches no device memory."""
    ensure_registered()
    device = device or jax.devices()[0]
    keys = {(tuple(l.shape), jnp.dtype(l.dtype)) for l in jax.tree.leaves(shapes)}
    for shape, dtype in keys:
        _program(shape, dtype, device)
    return len(keys)


def random_bit_flips(rng: np.random.Generator, tree: Any, count: int) -> list[tuple[Any, int, int]]:
    """``count`` distinct (leaf path, element, bit) triples, leaves drawn in proportion to size."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sizes = np.array([leaf.size for _, leaf in leaves], dtype=np.float64)
    chosen: set[tuple[int, int, int]] = set()
    while len(chosen) < count:
        k = int(rng.choice(len(leaves), p=sizes / sizes.sum()))
        leaf = leaves[k][1]
        chosen.add((k, int(rng.integers(leaf.size)), int(rng.integers(8 * leaf.dtype.itemsize))))
    return [(leaves[k][0], i, b) for k, i, b in sorted(chosen)]

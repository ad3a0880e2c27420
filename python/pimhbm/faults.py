"""Fault injection for tests and demos: deterministic damage to real tensors."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@functools.partial(jax.jit, donate_argnums=0)
def _flip(x: jax.Array, index: jax.Array, mask: jax.Array) -> jax.Array:
    flat = x.reshape(-1)
    uint = _UINT_OF_SIZE[flat.dtype.itemsize]
    if flat.dtype == jnp.bool_:
        return flat.at[index].set(~flat[index]).reshape(x.shape)
    word = jax.lax.bitcast_convert_type(flat[index], uint) ^ mask.astype(uint)
    return flat.at[index].set(jax.lax.bitcast_convert_type(word, flat.dtype)).reshape(x.shape)


def flip_bit(x: jax.Array, index: int, bit: int) -> jax.Array:
    """``x`` with bit ``bit`` of flat element ``index`` flipped (the input buffer is donated)."""
    x = jnp.asarray(x)
    bits = 8 * x.dtype.itemsize
    if not 0 <= index < x.size:
        raise IndexError(f"element {index} is outside a tensor of {x.size} elements")
    if not 0 <= bit < bits:
        raise ValueError(f"bit {bit} is outside a {bits}-bit {x.dtype} element")
    return _flip(x, jnp.int32(index), np.uint64(1 << bit) if bits == 64 else np.uint32(1 << bit))


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

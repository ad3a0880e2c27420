"""A step's number and scalars: the learning rate and the two bias corrections, in float32 as
optax makes them, and whether they can make finite values at all (both updates hold a step
whose scalars cannot: it would write NaN or infinite values everywhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_count(step: jax.Array) -> jax.Array:
    """This step's number (1 after none committed) from the count of committed steps, through a
    barrier: every use reads the copies' majority once, so no fusion reads the copies themselves
    -- one that did (the scalars' verdict, say) would keep the new copies from taking the donated
    buffer's place, and XLA's GPU compile would copy them."""
    return jax.lax.optimization_barrier(step) + 1


def step_scalars(lr, count, b1, b2) -> jax.Array:
    """float32 (3,): lr, 1 - b1^t, 1 - b2^t, computed exactly as optax computes them."""
    bc1 = 1 - b1 ** count
    bc2 = 1 - b2 ** count
    return jnp.stack([jnp.asarray(lr, jnp.float32), bc1.astype(jnp.float32),
                      bc2.astype(jnp.float32)])


def unusable(scalars: jax.Array) -> jax.Array:
    """bool: one of a step's ``scalars`` is not finite, or a bias correction is not above 0.
    Three compares and no reduction (the step's summary holds none)."""
    lr, bc1, bc2 = scalars[0], scalars[1], scalars[2]
    return ~(jnp.isfinite(lr) & jnp.isfinite(bc1) & jnp.isfinite(bc2)) | (bc1 <= 0) | (bc2 <= 0)


def for_the_kernel(scalars: jax.Array) -> jax.Array:
    """The scalars an update that runs whatever the verdict (two slots) is given: where they are
    unusable, lr 0 and bias corrections 1, so that its count of non-finite new values is the
    gradients' and the settings' own, not every element (the step is held on ``unusable``)."""
    return jnp.where(unusable(scalars), jnp.array([0.0, 1.0, 1.0], jnp.float32), scalars)

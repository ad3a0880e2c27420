"""A small MLP classifier on a fixed random teacher: the recovery engine's test subject when a
transformer would be too slow (a CPU fault campaign of hundreds of steps)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def init(seed: int, sizes: tuple[int, ...] = (32, 96, 96, 10), dtype=jnp.bfloat16) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    params = {}
    for i, (k, n_in, n_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (jax.random.normal(k, (n_in, n_out), jnp.float32) / np.sqrt(n_in)).astype(dtype)
        params[f"b{i}"] = jnp.zeros((n_out,), dtype)
    return params


def loss(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    h = batch["x"].astype(jnp.float32)
    n = len(params) // 2
    for i in range(n):
        h = h @ params[f"w{i}"].astype(jnp.float32) + params[f"b{i}"].astype(jnp.float32)
        if i < n - 1:
            h = jnp.tanh(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def batches(seed: int, batch: int = 64, n_in: int = 32, classes: int = 10):
    """batch_fn(step) -> {"x", "y"}: deterministic from (seed, step); labels from a fixed
    random linear teacher so that there is something to learn."""
    teacher = np.random.default_rng(seed).standard_normal((n_in, classes)).astype(np.float32)

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, step])
        x = rng.standard_normal((batch, n_in)).astype(np.float32)
        return {"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}

    return batch_fn

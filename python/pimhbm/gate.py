"""The insulation gate: non-finite values never flow on, forward or backward.

``insulate(x, probe)`` replaces NaN/Inf in ``x`` by zero and returns how many there were; in the
backward pass it zeros non-finite cotangents (and the cotangents of the values it replaced) and
adds how many there were to the gradient of ``probe``. Counts are device values: fetch them
with the step's other outputs, never print them inside the step.

``healthy_mean(grads, ok, axis_name)`` averages gradients over the data-parallel replicas that
report ``ok``, leaving the others out (a select and a psum: a faulty replica's NaN never enters
the sum). If no replica is healthy the mean is NaN, which the guarded update refuses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


@jax.custom_vjp
def _insulate(x: jax.Array, probe: jax.Array) -> tuple[jax.Array, jax.Array]:
    ok = jnp.isfinite(x)
    return jnp.where(ok, x, jnp.zeros_like(x)), jnp.sum(~ok, dtype=jnp.int32)


def _insulate_fwd(x, probe):
    ok = jnp.isfinite(x)
    return (jnp.where(ok, x, jnp.zeros_like(x)), jnp.sum(~ok, dtype=jnp.int32)), ok


def _insulate_bwd(ok, cotangents):
    ct, _ = cotangents
    ct_ok = jnp.isfinite(ct)
    ct_x = jnp.where(ok & ct_ok, ct, jnp.zeros_like(ct))
    return ct_x, jnp.sum(~ct_ok).astype(jnp.float32)


_insulate.defvjp(_insulate_fwd, _insulate_bwd)


def probe() -> jax.Array:
    """A zero float32 scalar to pass to ``insulate``: its gradient is the number of non-finite
    cotangents the gates zeroed in the backward pass."""
    return jnp.zeros((), jnp.float32)


def insulate(x: jax.Array, probe: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(x with NaN/Inf replaced by 0, their count as int32). Differentiate with respect to
    ``probe`` (see :func:`probe`) to get the backward count; without a probe it is dropped."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"insulate needs a floating-point array, got {x.dtype}")
    if probe is None:
        probe = jnp.zeros((), jnp.float32)
    probe = jnp.asarray(probe)
    if probe.shape != () or probe.dtype != jnp.float32:
        raise TypeError(f"probe must be a float32 scalar, got {probe.dtype}{tuple(probe.shape)}")
    return _insulate(x, probe)


def insulate_tree(tree: Any, probe: jax.Array | None = None) -> tuple[Any, jax.Array]:
    """``insulate`` on every leaf; returns the tree and the total forward count."""
    outs = jax.tree.map(lambda x: insulate(x, probe), tree)
    leaves = jax.tree.leaves(outs, is_leaf=lambda o: isinstance(o, tuple) and len(o) == 2)
    clean = jax.tree.map(lambda o: o[0], outs, is_leaf=lambda o: isinstance(o, tuple) and len(o) == 2)
    return clean, sum((o[1] for o in leaves), jnp.int32(0))


def healthy_mean(grads: Any, ok: jax.Array, axis_name: Any) -> tuple[Any, jax.Array]:
    """Mean of ``grads`` over the replicas of ``axis_name`` whose ``ok`` is true; returns the
    mean and the number of healthy replicas. Call it inside ``shard_map``/``pmap``."""
    ok = jnp.asarray(ok)
    if ok.shape != () or ok.dtype != jnp.bool_:
        raise TypeError(f"ok must be a bool scalar (this replica's verdict), got {ok.dtype}{tuple(ok.shape)}")
    n_ok = jax.lax.psum(ok.astype(jnp.int32), axis_name)

    def mean(g):
        total = jax.lax.psum(jnp.where(ok, g, jnp.zeros_like(g)), axis_name)
        # 0 / 0 = NaN when no replica is healthy: a step that the guarded update skips.
        return (total / n_ok.astype(total.dtype)).astype(g.dtype)

    return jax.tree.map(mean, grads), n_ok

"""The insulation gate and the healthy-replica mean (4 virtual CPU devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pimhbm


def poisoned(rng, shape, k):
    x = rng.standard_normal(shape).astype(np.float32)
    idx = rng.choice(x.size, size=k, replace=False)
    x.reshape(-1)[idx] = np.array([np.nan, np.inf, -np.inf])[np.arange(k) % 3]
    return x, set(idx.tolist())


def test_insulate_forward_zeros_and_counts(rng):
    x, bad = poisoned(rng, (37, 41), 9)
    y, count = jax.jit(pimhbm.insulate)(x)
    assert int(count) == 9
    y = np.asarray(y).reshape(-1)
    assert all(y[i] == 0 for i in bad)
    keep = np.ones(y.size, bool)
    keep[list(bad)] = False
    np.testing.assert_array_equal(y[keep], x.reshape(-1)[keep])


def test_insulate_backward_zeros_nonfinite_cotangents_and_counts_them(rng):
    x, bad_x = poisoned(rng, (300,), 4)
    w, bad_w = poisoned(rng, (300,), 5)  # the cotangent of y will be w

    def loss(x, probe):
        y, _ = pimhbm.insulate(x, probe)
        return jnp.sum(y * jax.lax.stop_gradient(w_clean) + jax.lax.stop_gradient(w_bad) * y)

    # d loss / d y = w (with NaN/Inf); split so that the product never makes new NaN.
    w_clean = np.where(np.isfinite(w), w, 0).astype(np.float32)
    w_bad = np.where(np.isfinite(w), 0, w).astype(np.float32)
    gx, gprobe = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, pimhbm.probe())
    gx = np.asarray(gx)
    assert np.all(np.isfinite(gx))
    assert int(gprobe) == len(bad_w)  # every non-finite cotangent counted
    for i in range(300):
        want = 0.0 if (i in bad_x or i in bad_w) else w[i]
        assert gx[i] == np.float32(want), i


def test_insulate_rejects_integers():
    with pytest.raises(TypeError, match="floating-point"):
        pimhbm.insulate(jnp.arange(3))


def test_insulate_tree_counts_every_leaf(rng):
    a, _ = poisoned(rng, (10,), 2)
    b, _ = poisoned(rng, (3, 3), 3)
    clean, count = pimhbm.insulate_tree({"a": a, "b": b})
    assert int(count) == 5
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(clean))


def _mesh():
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return Mesh(np.array(jax.devices("cpu")[:4]), ("dp",))


def _run_healthy_mean(grads, ok):
    mesh = _mesh()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("dp"), P("dp")),
                       out_specs=(P("dp"), P("dp")))
    def f(g, ok):
        mean, n_ok = pimhbm.healthy_mean({"w": g[0]}, ok[0], "dp")
        return mean["w"][None], n_ok[None]

    mean, n_ok = f(jax.device_put(grads), jax.device_put(ok))
    return np.asarray(mean), np.asarray(n_ok)


def test_healthy_mean_leaves_out_the_faulty_replica(rng):
    grads = rng.standard_normal((4, 1000)).astype(np.float32)
    faulty = int(rng.integers(4))
    grads[faulty, rng.integers(1000)] = np.nan
    ok = np.ones(4, bool)
    ok[faulty] = False
    mean, n_ok = _run_healthy_mean(grads, ok)
    want = np.mean(np.delete(grads, faulty, axis=0), axis=0)
    assert (n_ok == 3).all()
    for r in range(4):  # every replica holds the same mean
        np.testing.assert_allclose(mean[r], want, rtol=1e-6, atol=1e-7)


def test_healthy_mean_with_every_replica_faulty_is_nan(rng):
    grads = rng.standard_normal((4, 10)).astype(np.float32)
    mean, n_ok = _run_healthy_mean(grads, np.zeros(4, bool))
    assert (n_ok == 0).all() and np.isnan(mean).all()

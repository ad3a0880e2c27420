"""The Trainer's compile counter: a program XLA compiles, and one taken from the persistent
compilation cache (the test session keeps one, conftest.py), each count once -- so that "0
compilations after prewarm" cannot hide a program obtained late from the cache."""

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm.recovery.programs import CompileCounter


def test_a_compilation_and_a_cache_hit_each_count(rng):
    scale = float(rng.uniform(1.5, 2.5))  # a fresh program each run: not in the cache yet
    f = jax.jit(lambda x: jnp.sin(x) * scale + 1.0)
    x = jnp.asarray(rng.standard_normal(7).astype(np.float32))
    counter = CompileCounter()
    with counter:
        f(x).block_until_ready()
    assert counter.count == 1  # compiled (and written to the cache)
    jax.clear_caches()  # the in-memory caches go; the persistent one stays
    with counter:
        f(x).block_until_ready()
    assert counter.count == 2, "a program taken from the persistent cache was not counted"
    with counter:
        f(x).block_until_ready()  # in memory now: nothing compiled, nothing counted
    assert counter.count == 2
    f(x + 1).block_until_ready()  # outside the counter: not listened to
    jax.clear_caches()
    f(x).block_until_ready()
    assert counter.count == 2

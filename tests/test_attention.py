"""pimhbm.attention against jax.nn.dot_product_attention (XLA's, in float32 from the same bf16
inputs), forward and gradients, on random grouped-query shapes whose sequence lengths are no
multiple of any tile, head dims 16 to 128, batch 1 and 3; two runs bitwise equal; bad shapes
and dtypes refused with a clear error, by the Python front and by the FFI handler itself; batch
and kv heads sharded under plain jit with no gather; vmap folded into the batch. On a GPU the
same checks run on the CUDA kernels, plus: against cuDNN's attention and the CPU reference."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pimhbm
from conftest import has_gpu, needs_devices, requires_gpu

# batch, seq, heads, kv_heads, head_dim, causal
SHAPES = [(1, 1, 2, 1, 64, True), (3, 67, 4, 2, 64, True), (1, 130, 8, 2, 128, True),
          (3, 45, 4, 4, 128, False), (1, 200, 6, 3, 64, False), (3, 129, 4, 1, 128, True),
          (2, 70, 4, 2, 16, True), (1, 97, 2, 1, 32, False)]
# Errors relative to the largest reference value: bf16 outputs (2^-8), and on the GPU bf16
# probabilities and score gradients inside the products, as every fused attention keeps them.
TOL = 2e-2


def inputs(rng, batch, seq, heads, kv_heads, head_dim):
    draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    return (draw(batch, seq, heads, head_dim), draw(batch, seq, kv_heads, head_dim),
            draw(batch, seq, kv_heads, head_dim), draw(batch, seq, heads, head_dim))


def reference(q, k, v, causal, implementation="xla"):
    f = lambda x: x.astype(jnp.float32) if implementation == "xla" else x
    return jax.nn.dot_product_attention(f(q), f(k), f(v), is_causal=causal,
                                        implementation=implementation)


def value_and_grads(fn, q, k, v, g):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(g.astype(out.dtype)))


def ours(causal):
    return jax.jit(lambda q, k, v: pimhbm.attention(q, k, v, causal=causal))


def assert_close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    # The floor: a gradient that is zero in exact arithmetic (one key: the softmax is constant)
    # is rounding noise in both, not a scale.
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-2)
    assert err <= TOL, f"{what}: max error {err:.4f} of the largest value (tolerance {TOL})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_t{}_h{}_kv{}_d{}_{}".format(
    *s[:5], "causal" if s[5] else "full"))
def test_matches_xla_attention(rng, shape):
    q, k, v, g = inputs(rng, *shape[:5])
    causal = shape[5]
    got = value_and_grads(ours(causal), q, k, v, g)
    want = value_and_grads(lambda q, k, v: reference(q, k, v, causal), q, k, v, g)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.dtype == jnp.bfloat16 and a.shape == b.shape, name
        assert_close(a, b, name)


def test_mask_and_group_are_real(rng):
    """Positive controls: the comparison above fails for the wrong mask and the wrong kv head
    (query head h must read kv head h // group, not h % kv_heads)."""
    q, k, v, _ = inputs(rng, 1, 70, 4, 2, 64)
    got = ours(True)(q, k, v)
    with pytest.raises(AssertionError):
        assert_close(got, reference(q, k, v, False), "o against a full mask")
    k_tiled = jnp.tile(k, (1, 1, 2, 1))  # head h reads kv head h % 2
    v_tiled = jnp.tile(v, (1, 1, 2, 1))
    with pytest.raises(AssertionError):
        assert_close(got, reference(q, k_tiled, v_tiled, True), "o against interleaved heads")


def test_two_runs_are_bitwise_equal(rng):
    q, k, v, g = inputs(rng, 3, 131, 8, 2, 128)
    step = jax.jit(lambda q, k, v, g: value_and_grads(pimhbm.attention, q, k, v, g))
    first, second = step(q, k, v, g), step(q, k, v, g)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_vmap_folds_into_the_batch(rng):
    """jax.vmap over a leading axis computes what a loop over it does, bit for bit, forward
    and backward."""
    q, k, v, g = (jnp.stack(xs) for xs in zip(*(inputs(rng, 2, 40, 4, 2, 64) for _ in range(3))))
    mapped = jax.jit(jax.vmap(lambda q, k, v, g: value_and_grads(pimhbm.attention, q, k, v, g)))
    looped = [value_and_grads(pimhbm.attention, q[i], k[i], v[i], g[i]) for i in range(3)]
    for j, got in enumerate(mapped(q, k, v, g)):
        want = jnp.stack([out[j] for out in looped])
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("bad, message", [
    (dict(dtype=jnp.float32), "q must be bfloat16"),
    (dict(q_shape=(1, 8, 2, 96)), "head_dim must be 16, 32, 64 or 128"),
    (dict(k_shape=(1, 8, 3, 64)), r"kv_heads \(3\) must divide q's heads \(4\)"),
    (dict(k_shape=(1, 9, 2, 64)), "k and v must be"),
    (dict(q_shape=(8, 4, 64)), "must be 4-d"),
])
def test_bad_inputs_are_refused(bad, message):
    q = jnp.zeros(bad.get("q_shape", (1, 8, 4, 64)), bad.get("dtype", jnp.bfloat16))
    k = jnp.zeros(bad.get("k_shape", (1, 8, 2, 64)), jnp.bfloat16)
    with pytest.raises((TypeError, ValueError), match=message):
        pimhbm.attention(q, k, k)


def test_handler_checks_its_inputs():
    """The FFI handler refuses what the Python front would have: a direct call gets its own
    message, not a crash."""
    pimhbm.attention(*(jnp.zeros((1, 4, 2, 64), jnp.bfloat16),) * 3)  # registers the targets
    rows = jax.ShapeDtypeStruct((1, 2, 4), jnp.float32)
    call = jax.ffi.ffi_call("pimhbm_attention_fwd",
                            (jax.ShapeDtypeStruct((1, 4, 2, 64), jnp.bfloat16), rows))
    kv = jnp.zeros((1, 4, 2, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="pimhbm.attention: q must be bfloat16"):
        jax.block_until_ready(call(jnp.zeros((1, 4, 2, 64), jnp.float32), kv, kv,
                                   causal=np.bool_(True)))
    with pytest.raises(Exception, match="pimhbm.attention: v must be bfloat16"):
        jax.block_until_ready(call(kv, kv, jnp.zeros((1, 4, 1, 64), jnp.bfloat16),
                                   causal=np.bool_(True)))


def test_sharded_batch_and_kv_heads_need_no_gather(rng):
    needs_devices(4)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    q, k, v, g = inputs(rng, 2, 70, 8, 4, 64)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("dp", None, "tp", None)))
    step = jax.jit(lambda q, k, v, g: value_and_grads(pimhbm.attention, q, k, v, g))
    text = step.lower(*map(put, (q, k, v, g))).compile().as_text()
    assert not re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)\b", text)
    sharded, whole = step(*map(put, (q, k, v, g))), step(q, k, v, g)
    for a, b in zip(sharded, whole):
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp", None)), 4)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    # Positive control: a sequence split across devices must be gathered (every query sees
    # earlier keys), and the check above would see it.
    q, k, v, g = inputs(rng, 2, 64, 8, 4, 64)
    by_seq = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, ("dp", "tp"), None, None)))
    text = step.lower(*map(by_seq, (q, k, v, g))).compile().as_text()
    assert re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)\b", text)


def test_a_llama_layer_on_pimhbm_attention(rng):
    """The model's attention_impl="pimhbm": a bf16 decoder layer's gradients match XLA's
    attention to bf16 tolerance and repeat bit for bit."""
    from pimhbm.models import llama3

    cfg = llama3.Config(vocab=64, hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1,
                        head_dim=64)
    layer = llama3.init(jax.random.key(int(rng.integers(1 << 30))), cfg)["layers"][0]
    x = jnp.asarray(rng.standard_normal((2, 75, cfg.hidden)), jnp.bfloat16)

    def grads(impl):
        f = lambda p, x: jnp.sum(llama3.decoder_layer(p, x, cfg, impl).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1)))(layer, x)

    ours, again, xla = grads(llama3.PIMHBM_ATTENTION), grads(llama3.PIMHBM_ATTENTION), grads("xla")
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(again),
                               jax.tree.leaves(xla)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
        assert_close(a, c, jax.tree_util.keystr(path))


# cuDNN's own limits: even sequence lengths (JAX refuses odd ones for its masked kernels).
CUDNN_SHAPES = [(3, 66, 4, 2, 64, True), (1, 130, 8, 2, 128, True), (3, 46, 4, 4, 128, False),
                (1, 200, 6, 3, 64, False), (2, 1000, 8, 2, 128, True), (2, 70, 4, 2, 16, True),
                (1, 96, 2, 1, 32, False)]


@requires_gpu
@pytest.mark.parametrize("shape", CUDNN_SHAPES, ids=lambda s: "t{}_d{}".format(s[1], s[4]))
def test_gpu_matches_cudnn_and_the_cpu_reference(rng, shape):
    q, k, v, g = inputs(rng, *shape[:5])
    causal = shape[5]
    got = value_and_grads(ours(causal), q, k, v, g)
    cudnn = value_and_grads(lambda q, k, v: reference(q, k, v, causal, "cudnn"), q, k, v, g)
    cpu = jax.devices("cpu")[0]
    on_cpu = value_and_grads(ours(causal), *(jax.device_put(x, cpu) for x in (q, k, v, g)))
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), got, cudnn, on_cpu):
        assert_close(a, b, f"{name} against cuDNN")
        assert_close(a, c, f"{name} against the CPU reference")


def test_runs_where_expected():
    """The GPU checks above run on a GPU machine (a positive control of the skip)."""
    assert has_gpu() == any(d.platform == "gpu" for d in jax.devices())


def test_the_trainer_on_pimhbm_attention(rng):
    """The engine's step on pimhbm.attention and the ordered embedding (exact mode without XLA's
    flag), data parallel over 4 devices: every step's re-execution on another device agrees bit
    for bit (else an incident and a replay), nothing compiles after prewarm."""
    needs_devices(4)
    from pimhbm.models import llama3
    from pimhbm.train import llama_trainer

    cfg = llama3.Config(vocab=256, hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1,
                        head_dim=64)
    data = rng.integers(0, 256, size=50_000, dtype=np.uint8).tobytes()
    trainer = llama_trainer(cfg, data, steps=6, batch=4, seq=32, devices=jax.devices()[:4],
                            attention_impl=llama3.PIMHBM_ATTENTION, ordered_embedding=True,
                            recheck_every=1, telemetry=None)
    try:
        trainer.prewarm()
        stats = trainer.run(6)
    finally:
        trainer.close()
    assert (stats.steps_committed, stats.steps_replayed, stats.incidents) == (6, 0, [])
    assert stats.compiles_after_prewarm == 0

"""Causal grouped-query attention whose every replay is bit-identical, at tensor-core speed.

``attention(q, k, v)`` with q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads,
head_dim] (bfloat16; head_dim 16, 32, 64 or 128; kv_heads dividing heads; any sequence length)
returns softmax(q k^T / sqrt(head_dim)) v, causal by default, as ``jax.nn.dot_product_attention`` does,
and is differentiable (``jax.custom_vjp``). Its kernels (csrc/attention) sum every value in a
fixed order -- the backward pass computes dK and dV per key tile and dQ per query tile, never by
atomics -- so two runs on the same inputs are equal bit for bit without XLA's global
``--xla_gpu_deterministic_ops`` flag, which is what exact replay needs. On CPUs the same op runs
the plain C++ reference.

Under ``jax.jit`` with sharded inputs each device computes its own sequences and kv heads (the
batch dimension and the heads dimension may be sharded; sequence and head_dim are gathered);
under ``jax.vmap`` the mapped axis joins the batch.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from pimhbm._ffi import ensure_registered

HEAD_DIMS = (16, 32, 64, 128)


class _Layout(enum.Enum):
    """An operand's or result's layout, as Shardy's factors: q's heads are (kv head, member of
    its group), so the kv heads may be split across devices with their query heads; sequence,
    head_dim and the group stay whole."""

    Q = "b t (k g) d"  # [batch, seq, heads, head_dim]: q, o, dO, dq
    KV = "b t k d"  # [batch, seq, kv_heads, head_dim]: k, v, dk, dv
    ROWS = "b (k g) t"  # [batch, heads, seq]: lse, delta

    def spec(self, batch, heads) -> P:
        return P(batch, heads, None) if self is _Layout.ROWS else P(batch, None, heads, None)


def _check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.bfloat16:
            raise TypeError(f"pimhbm.attention: {name} must be bfloat16, got {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"pimhbm.attention: {name} must be 4-d [batch, seq, heads, "
                             f"head_dim], got shape {x.shape}")
    batch, seq, heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"pimhbm.attention: head_dim must be 16, 32, 64 or 128, got {head_dim}")
    if k.shape != v.shape or k.shape[:2] != (batch, seq) or k.shape[3] != head_dim:
        raise ValueError(f"pimhbm.attention: k and v must be [batch, seq, kv_heads, head_dim] "
                         f"with q's batch, seq and head_dim {(batch, seq, head_dim)}, got "
                         f"k {k.shape} and v {v.shape}")
    if k.shape[2] < 1 or heads % k.shape[2]:
        raise ValueError(f"pimhbm.attention: kv_heads ({k.shape[2]}) must divide q's heads "
                         f"({heads})")


def _rows(q: jax.Array) -> jax.ShapeDtypeStruct:
    batch, seq, heads, _ = q.shape
    return jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)


def _fwd_call(causal: bool, q, k, v):
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), _rows(q))
    return tuple(jax.ffi.ffi_call("pimhbm_attention_fwd", out, vmap_method="sequential")(
        q, k, v, causal=np.bool_(causal)))


def _bwd_call(causal: bool, q, k, v, o, lse, g):
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(v.shape, v.dtype), _rows(q))
    return tuple(jax.ffi.ffi_call("pimhbm_attention_bwd", out, vmap_method="sequential")(
        q, k, v, o, lse, g, causal=np.bool_(causal)))


def _axes(sharding, dim: int):
    spec = getattr(sharding, "spec", None)
    return spec[dim] if spec is not None and dim < len(spec) else None


def _sharded(call, ins: tuple[_Layout, ...], outs: tuple[_Layout, ...]):
    """``call`` as an op XLA partitions over the batch and kv-head dimensions, its operands and
    results laid out as ``ins`` and ``outs`` say."""
    op = custom_partitioning(call)
    rule = (", ".join(l.value for l in ins) + " -> " + ", ".join(l.value for l in outs))

    def partition(mesh, arg_shapes, result_shape):
        batch, heads = _axes(arg_shapes[0].sharding, 0), _axes(arg_shapes[1].sharding, 2)
        return (mesh, call, tuple(NamedSharding(mesh, l.spec(batch, heads)) for l in outs),
                tuple(NamedSharding(mesh, l.spec(batch, heads)) for l in ins))

    def sharding_rule(mesh, value_types, result_types):
        group = value_types[0].shape[2] // value_types[1].shape[2]
        # Factors in order of first appearance: b t k g d (Shardy wants them sorted).
        return rule, dict(need_replication_factors=("t", "g", "d"), g=group)

    op.def_partition(partition=partition, sharding_rule=sharding_rule)

    # Under jax.vmap the mapped axis joins the batch: every operand and result leads with it.
    @jax.custom_batching.custom_vmap
    def call_op(*xs):
        return op(*xs)

    @call_op.def_vmap
    def batched(axis_size, in_batched, *xs):
        xs = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
              for x, b in zip(xs, in_batched)]
        outs = call_op(*(x.reshape(-1, *x.shape[2:]) for x in xs))
        return (tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs),
                tuple(True for _ in outs))

    return call_op


@functools.cache
def _ops(causal: bool):
    q, kv, rows = _Layout.Q, _Layout.KV, _Layout.ROWS
    fwd = _sharded(functools.partial(_fwd_call, causal), (q, kv, kv), (q, rows))
    bwd = _sharded(functools.partial(_bwd_call, causal), (q, kv, kv, q, rows, q),
                   (q, kv, kv, rows))

    @jax.custom_vjp
    def attend(q, k, v):
        return fwd(q, k, v)[0]

    def attend_fwd(q, k, v):
        o, lse = fwd(q, k, v)
        return o, (q, k, v, o, lse)

    def attend_bwd(res, g):
        q, k, v, o, lse = res
        dq, dk, dv, _ = bwd(q, k, v, o, lse, g.astype(jnp.bfloat16))
        return dq, dk, dv

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v over grouped-query heads, bfloat16 in and out (float32
    sums), causal unless ``causal=False``; bitwise repeatable, forward and backward."""
    ensure_registered()
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check(q, k, v)
    return _ops(bool(causal))(q, k, v)

"""pimhbm.attention against cuDNN's fused attention (``jax.nn.dot_product_attention``,
implementation "cudnn"), side by side in one run: forward, and forward + backward, causal,
bf16, grouped-query heads of Llama-3-8B (32 query heads, 8 kv heads, head dim 128; or 64 with
--head-dim 64), a fixed number of tokens per call split into sequences of 1k to 16k.

TFLOP/s count the causal products only (forward 4 b t^2 h d / 2; backward 2.5x that, the
convention of FlashAttention's papers), so both rows are counted alike: ours recomputes the
scores twice in its backward pass (dK/dV and dQ are separate passes), which it pays in time,
not in credited work. Each row also says whether two runs of ours were bitwise equal.

usage: python bench/attention_bench.py [--tokens 16384] [--seqs 1024,2048,4096,8192,16384]
                                       [--head-dim 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import time_jax, write_json  # noqa: E402

import pimhbm  # noqa: E402


def timed(attend, q, k, v, r):
    fwd = jax.jit(lambda q, k, v: attend(q, k, v))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * r)
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return time_jax(fwd, q, k, v), time_jax(both, q, k, v), both


def row(args, seq: int) -> dict:
    heads, kv_heads, d = (32, 8, 128) if args.head_dim == 128 else (64, 16, 64)
    batch = max(1, args.tokens // seq)
    keys = iter(jax.random.split(jax.random.key(seq), 4))
    draw = lambda h: jax.random.normal(next(keys), (batch, seq, h, d), jnp.bfloat16)
    q, k, v, r = draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="cudnn")
    ours_f, ours_fb, ours_grad = timed(pimhbm.attention, q, k, v, r)
    cu_f, cu_fb, _ = timed(cudnn, q, k, v, r)
    a, b = ours_grad(q, k, v), ours_grad(q, k, v)
    repeatable = all(np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
                     for x, y in zip(a, b))
    flops = 4 * batch * seq * seq * heads * d / 2
    tf = lambda work, s: work / s / 1e12
    return dict(seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d,
                ours_fwd_ms=ours_f * 1e3, cudnn_fwd_ms=cu_f * 1e3,
                ours_fwd_bwd_ms=ours_fb * 1e3, cudnn_fwd_bwd_ms=cu_fb * 1e3,
                ours_fwd_tflops=tf(flops, ours_f), cudnn_fwd_tflops=tf(flops, cu_f),
                ours_bwd_tflops=tf(2.5 * flops, ours_fb - ours_f),
                cudnn_bwd_tflops=tf(2.5 * flops, cu_fb - cu_f),
                ratio_fwd_bwd=ours_fb / cu_fb, repeatable=repeatable)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    p.add_argument("--json")
    args = p.parse_args()
    if jax.devices()[0].platform != "gpu":
        print("attention_bench: needs a CUDA GPU (cuDNN's attention is the baseline)")
        return 1
    rows = []
    print(f"{'seq':>6} {'batch':>5} | fwd ms ours/cuDNN | TFLOP/s fwd ours/cuDNN | "
          f"fwd+bwd ms ours/cuDNN (ratio) | TFLOP/s bwd ours/cuDNN | repeatable")
    for seq in (int(s) for s in args.seqs.split(",")):
        r = row(args, seq)
        rows.append(r)
        print(f"{r['seq']:>6} {r['batch']:>5} | {r['ours_fwd_ms']:7.3f} / {r['cudnn_fwd_ms']:7.3f} | "
              f"{r['ours_fwd_tflops']:6.1f} / {r['cudnn_fwd_tflops']:6.1f} | "
              f"{r['ours_fwd_bwd_ms']:7.3f} / {r['cudnn_fwd_bwd_ms']:7.3f} "
              f"({r['ratio_fwd_bwd']:.2f}x) | {r['ours_bwd_tflops']:6.1f} / "
              f"{r['cudnn_bwd_tflops']:6.1f} | {r['repeatable']}", flush=True)
    write_json(args.json, dict(device=str(jax.devices()[0].device_kind), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

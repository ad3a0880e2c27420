"""Two forward + backward passes of pimhbm.attention at the Llama-3-8B layer's shape (4 x 4096
tokens, 32 query heads, 8 kv heads, head dim 128), for Nsight Compute: `ncu --kernel-name
regex:'forward_kernel|dkdv_kernel|dq_kernel' --launch-skip 3 ... python
bench/attention_profile.py`. Prints nothing of its own."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pimhbm


def main() -> None:
    keys = iter(jax.random.split(jax.random.key(0), 4))
    draw = lambda h: jax.random.normal(next(keys), (4, 4096, h, 128), jnp.bfloat16)
    q, k, v, r = draw(32), draw(8), draw(8), draw(32)
    loss = lambda q, k, v: jnp.sum(pimhbm.attention(q, k, v).astype(jnp.float32) * r)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for _ in range(2):
        jax.block_until_ready(grad(q, k, v))


if __name__ == "__main__":
    main()

"""A few steps of the in-place update (and of the two-slot one beside it) at 268 M fp32
parameters, for Nsight Compute: `ncu --kernel-name regex:inplace_kernel ... python
bench/inplace_profile.py`. Prints nothing of its own but the steps' verdicts."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import pimhbm
from pimhbm import inplace


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 28
    for dtype, master in ((jnp.float32, False), (jnp.bfloat16, True)):
        run(n, dtype, master)
    return 0


def run(n, dtype, master):
    params = {f"w{i}": jnp.full((n // 8,), 0.01, dtype) for i in range(8)}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for opt in (inplace.adamw(1e-4, master_weights=master), pimhbm.update.adamw(1e-4, master_weights=master)):
        step = jax.jit(lambda g, s: opt.update(g, s), donate_argnums=1)
        state = opt.init(params)
        for _ in range(3):
            state, report = step(grads, state)
        print(type(opt).__module__, dtype.__name__, bool(report.committed))
        del state


if __name__ == "__main__":
    sys.exit(main())

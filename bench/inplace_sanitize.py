"""The in-place update's CUDA kernels on ragged sizes, for compute-sanitizer: every parameter
kind, chunk sizes 128 to 512, groups 1 to 16, damage in every tensor, a repair, parity rebuilds.
Checks nothing itself beyond the repair's verdict (the bit-for-bit comparison with the CPU is
tests/test_inplace.py); run it under `compute-sanitizer --tool memcheck|racecheck`."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import inplace, parity


def case(rng, kind, n, chunk_elems, group):
    dtype = jnp.float32 if kind == "fp32" else jnp.bfloat16
    opt = inplace.adamw(1e-3, master_weights=kind == "bf16_master", chunk_elems=chunk_elems,
                        group=group)
    params = {"a": jnp.asarray(rng.standard_normal(n), dtype),
              "b": jnp.asarray(rng.standard_normal(max(1, n // 3)), dtype)}
    state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    state, _ = opt.update(grads, state)
    mu = np.asarray(state.mu["a"]).copy()
    mu.view(np.uint32)[rng.integers(0, n)] ^= 1 << 7
    state = state._replace(mu={**state.mu, "a": jnp.asarray(mu)})
    state, report = opt.update(grads, state)
    state, fixed = opt.repair(state, report)
    if not bool(fixed.complete):
        raise SystemExit(f"{kind} n={n} chunk={chunk_elems} group={group}: repair not complete: "
                         f"stash {np.asarray(report.stash.index)[:2].tolist()}, faults "
                         f"{int(fixed.faults)}, rebuilt {np.asarray(fixed.rebuilt['a'])[:2].tolist()}")
    cb = opt.chunk_bytes("p", dtype)
    rows = parity.parity(state.params["a"], cb, group)
    parity.rebuild(jnp.array([0, -1, 10**6]), state.params["a"], state.digests["a"]["p"], rows,
                   cb, group)


def main() -> int:
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for kind in ("fp32", "bf16", "bf16_master"):
        for n, chunk_elems, group in ((1, 128, 1), (129, 128, 2), (1001, 128, 3), (4097, 512, 1),
                                      (9000, 256, 5), (33, 512, 4), (70001, 512, 16)):
            case(rng, kind, n, chunk_elems, group)
    print("in-place update, repair and rebuild ran on every case")
    return 0


if __name__ == "__main__":
    sys.exit(main())

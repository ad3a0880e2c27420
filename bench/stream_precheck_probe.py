"""Probe: the checks before the in-place update, one call per leaf on a second stream.

The in-place update may write nothing before the step's verdict, and the verdict needs one pass
over the parameters and the gradients (pimhbm.inplace_calls.prechecks: ~4 bytes a parameter).
Run after the backward pass, that pass adds its whole time to the step. This probe replaces it,
in `pimhbm llama3`'s protected step, by one precheck call per leaf, each wrapped in
``compute_on("gpu_stream:1")``: under XLA's ``--xla_gpu_experimental_stream_annotation=true``
each call may then run on a stream of its own as soon as its gradient exists, beside the rest of
the backward pass. What it measures is only the time; the order it leaves (a leaf's check may
run before the backward pass's last read of that leaf's parameters) is not what the library
could ship.

usage: XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true \
       python bench/stream_precheck_probe.py [pimhbm llama3's options]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from pimhbm import inplace, inplace_calls
from pimhbm_cli import main


def per_leaf_on_stream(self, leaves, tables, grads):
    damaged, nonfinite, counts = [], [], jnp.zeros((2,), jnp.int32)
    for leaf, table, g in zip(leaves, tables, grads, strict=True):
        def check(p, t, g):
            return inplace_calls._precheck_ffi([p], [t], [g], [inplace_calls._whole_base()],
                                               self.chunk_elems)
        on_stream = compute_on(compute_type="gpu_stream:1",
                               out_memory_spaces=jax.memory.Space.Device)(check)
        d, n, totals = on_stream(leaf["p"], table["p"], g)
        damaged.append(d)
        nonfinite.append(n)
        counts = inplace_calls._saturating_add(counts, inplace_calls.saturated(totals))
    return inplace_calls.Prechecks(damaged, nonfinite, counts), grads


if __name__ == "__main__":
    inplace.AdamW._prechecks = per_leaf_on_stream
    sys.exit(main(["llama3", *sys.argv[1:]]))

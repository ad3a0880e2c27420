"""The glue between the checks, the update and the step's summary, side by side with what it
replaced, on the per-chunk maps of `pimhbm llama3`'s tree (2 decoder layers of 8B dimensions,
chunks of 256: ~1.7 M chunks in 21 leaves).

Two parts of every protected step:
* the verdict's counts: the checks' call with its own totals (now) against the same call
  followed by a sum of each leaf's maps (before: XLA's reduction a leaf);
* the summary: three pimhbm_fault_list calls (faults, NaN/Inf gradients, replicas'
  disagreement) against the XLA ops they replaced (the maps concatenated, counted, and listed by
  running sums: `first_nonzero` below, kept here as the anchor).

Each variant runs `--repeat` times inside one compiled loop (each pass depends on the last, so
XLA can neither hoist nor merge them): the figure is device time a pass, host dispatch
excluded. Maps with no entry (the steady state) and with a few.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from common import time_jax, write_json
from pimhbm import inplace
from pimhbm.inplace_calls import prechecks
from pimhbm.models import llama3
from pimhbm.recovery.summary import FaultList, listed

CAPACITY = 64  # the Trainer's fault_capacity
_BLOCK = 1024


def first_nonzero(flat: jax.Array, k: int) -> jax.Array:
    """The previous listing (XLA ops): positions of the first k non-zero entries of ``flat``, by
    a running count a block of _BLOCK entries and then inside the block where it is reached."""
    n = flat.shape[0]
    blocks = -(-n // _BLOCK)
    nz = jnp.pad((flat != 0).astype(jnp.int32), (0, blocks * _BLOCK - n)).reshape(blocks, _BLOCK)
    per_block = jnp.sum(nz, axis=1, dtype=jnp.int32)
    through = jnp.cumsum(per_block)
    target = jnp.arange(1, k + 1, dtype=jnp.int32)
    block = jnp.searchsorted(through, target, side="left", method="compare_all")
    found = block < blocks
    block = jnp.minimum(block, blocks - 1)
    before = through[block] - per_block[block]
    within = jnp.cumsum(nz[block], axis=1)
    place = jnp.sum(within < (target - before)[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(found, block * _BLOCK + place, -1).astype(jnp.int32)


def xla_list(maps: list[jax.Array]) -> tuple[FaultList, jax.Array, jax.Array]:
    if not maps:
        return FaultList(jnp.full((CAPACITY,), -1, jnp.int32),
                         jnp.zeros((CAPACITY,), jnp.int32)), jnp.int32(0), jnp.int32(0)
    flat = jax.lax.optimization_barrier(jnp.concatenate([m.reshape(-1) for m in maps]))
    idx = first_nonzero(flat, CAPACITY)
    value = jnp.where(idx >= 0, flat[jnp.maximum(idx, 0)], 0)
    return (FaultList(idx, value), jnp.sum(flat != 0, dtype=jnp.int32),
            jnp.sum(flat, dtype=jnp.int32))


def ffi_list(maps: list[jax.Array]) -> tuple[FaultList, jax.Array, jax.Array]:
    out = listed(maps, CAPACITY)
    return out.faults, out.nonzero, out.total


def summary_loop(lister, repeat: int):
    """``repeat`` summaries of (faults, grads) and an empty disagreement list, each pass's first
    maps offset by a value the last pass computed (zero, which XLA cannot know)."""
    def run(faults, grads):
        def body(_, carry):
            lists = [lister([faults[0] + carry, *faults[1:]]),
                     lister([grads[0] + carry, *grads[1:]]), lister([])]
            return jnp.minimum(sum(c[1] + c[0].index[0] for c in lists), 0)
        return jax.lax.fori_loop(0, repeat, body, jnp.int32(0))
    return jax.jit(run)


def verdict_loop(per_leaf_sums: bool, repeat: int, chunk_elems: int):
    """``repeat`` checks and their counts (the call's totals, or sums of its maps a leaf), each
    pass's first gradient offset by a value the last pass computed."""
    def run(params, tables, grads):
        def body(_, carry):
            g = [grads[0] + carry.astype(grads[0].dtype), *grads[1:]]
            damaged, nonfinite, counts = prechecks(params, tables, g, chunk_elems)
            if per_leaf_sums:
                total = lambda ms: sum((jnp.sum(m, dtype=jnp.int32) for m in ms), jnp.int32(0))
                counts = jnp.stack([total(damaged), total(nonfinite)])
            return jnp.minimum(counts.sum(), 0)
        return jax.lax.fori_loop(0, repeat, body, jnp.int32(0))
    return jax.jit(run)


def model_leaves(layers: int, chunk_elems: int, tiny: bool):
    cfg = llama3.tiny(layers=layers) if tiny else llama3.llama3_8b(layers=layers, vocab=8192)
    cfg = dataclasses.replace(cfg, dtype="bfloat16")
    params = llama3.init(jax.random.key(0), cfg)
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=chunk_elems)
    state = opt.init(params)
    leaves = jax.tree.leaves(params)
    tables = [d["p"] for d in jax.tree.leaves(state.digests, is_leaf=lambda x: "p" in x)]
    grads = [jnp.zeros_like(p) for p in leaves]
    return leaves, tables, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk-elems", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama (a check of the script)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console(width=120)
    dev = jax.devices()[0]
    params, tables, grads = model_leaves(args.layers, args.chunk_elems, args.tiny)
    chunks = [t.shape[0] for t in tables]
    console.print(f"{dev.device_kind}: {len(chunks)} leaves, {sum(chunks) / 1e6:.2f} M chunks "
                  f"of {args.chunk_elems}; {args.repeat} passes a compiled loop")
    rng = np.random.default_rng(0)
    zero = [jnp.zeros((c,), jnp.int32) for c in chunks]
    some = [jnp.asarray(np.where(rng.random(c) < 2e-6, 3, 0).astype(np.int32)) for c in chunks]
    rows, payload = [], {"device": dev.device_kind, "leaves": len(chunks),
                         "chunks": sum(chunks), "repeat": args.repeat, "results": {}}
    for name, maps in (("no entries", zero), ("a few entries", some)):
        for variant, lister in (("XLA ops (before)", xla_list), ("fault-list calls", ffi_list)):
            s = time_jax(summary_loop(lister, args.repeat), maps, maps, iters=3, reps=5)
            rows.append((f"summary, {name}", variant, s / args.repeat))
    for variant, per_leaf in (("maps summed a leaf (before)", True), ("the call's totals", False)):
        s = time_jax(verdict_loop(per_leaf, args.repeat, args.chunk_elems), params, tables, grads,
                     iters=3, reps=5)
        rows.append(("checks and the verdict's counts", variant, s / args.repeat))
    table = Table(title="The step's glue, device time a pass (median of 5 loops)")
    for col in ("what", "variant", "us", "vs before"):
        table.add_column(col, justify="right" if col in ("us", "vs before") else "left")
    for i, (what, variant, s) in enumerate(rows):
        before = rows[i - (i % 2)][2]
        table.add_row(what, variant, f"{s * 1e6:.1f}", f"{s / before:.3f}x")
        payload["results"][f"{what} / {variant}"] = {"us": s * 1e6, "vs before": s / before}
    console.print(table)
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``pimhbm scan-demo``: damage a model-sized pytree and find every fault by its chunk digests.

A Llama-style parameter tree (bf16 weights) with its AdamW state (fp32 master weights and
moments) is scanned once; then random single-bit flips and NaN/Inf values are written into it.
A second pass (verify + scan) must find every flip in exactly the chunk it was written to, every
non-finite value in its chunk, and nothing else. The table and the verdict are computed from
what the device reported, never assumed.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from rich.progress import Progress
from rich.table import Table

import pimhbm
from pimhbm import faults

from pimhbm_cli import options
from pimhbm_cli.options import add_device, non_negative_int, positive_int


def add_arguments(p) -> None:
    p.add_argument("--hidden", type=positive_int, default=512, help="model width")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--vocab", type=positive_int, default=8192, help="vocabulary size")
    p.add_argument("--flips", type=non_negative_int, default=32, help="single-bit flips to write")
    p.add_argument("--nonfinite", type=non_negative_int, default=6, help="NaN/Inf values to write")
    p.add_argument("--chunk-bytes", type=positive_int, default=None,
                   help="digest chunk size in bytes (a multiple of 16; default: the library's)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    add_device(p)

def llama_like_tree(key: jax.Array, hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """Parameters (bf16) and AdamW state (fp32) with Llama-3 proportions (GQA 4:1, SwiGLU)."""
    inter = int(hidden * 3.5) // 64 * 64
    kv = hidden // 4
    shapes = {"embed": (vocab, hidden), "final_norm": (hidden,), "lm_head": (hidden, vocab)}
    for i in range(layers):
        shapes |= {f"layer{i}.attn_norm": (hidden,), f"layer{i}.q": (hidden, hidden),
                   f"layer{i}.k": (hidden, kv), f"layer{i}.v": (hidden, kv),
                   f"layer{i}.o": (hidden, hidden), f"layer{i}.mlp_norm": (hidden,),
                   f"layer{i}.gate": (hidden, inter), f"layer{i}.up": (hidden, inter),
                   f"layer{i}.down": (inter, hidden)}
    keys = jax.random.split(key, len(shapes))
    master = {name: 0.02 * jax.random.normal(k, s, jnp.float32)
              for (name, s), k in zip(shapes.items(), keys)}
    return {
        "params": jax.tree.map(lambda m: m.astype(jnp.bfloat16), master),
        "master": master,
        "mu": jax.tree.map(lambda m: 1e-3 * m, master),
        "nu": jax.tree.map(lambda m: 1e-6 * m * m, master),
    }


def _path_str(path: Any) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


class Damage(NamedTuple):
    tree: Any  # the damaged copy of the state
    flips: list  # (path, element, bit)
    bad_values: list  # (path, element, NaN or +-Inf)


def _damage(tree: Any, rng: np.random.Generator, flips: int, nonfinite: int) -> Damage:
    """Random single-bit flips anywhere, and NaN/Inf values written into the fp32 state."""
    flipped = faults.random_bit_flips(rng, tree, flips)
    leaves = dict(jax.tree_util.tree_leaves_with_path(tree))
    for path, index, bit in flipped:
        leaves[path] = faults.flip_bit(leaves[path], index, bit)
    float_paths = [p for p in leaves if p[0].key != "params"]
    bad_values = []
    for _ in range(nonfinite):
        path = float_paths[int(rng.integers(len(float_paths)))]
        index = int(rng.integers(leaves[path].size))
        value = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
        flat = leaves[path].reshape(-1).at[index].set(value)
        leaves[path] = flat.reshape(leaves[path].shape)
        bad_values.append((path, index, value))
    damaged = jax.tree_util.tree_unflatten(jax.tree.structure(tree), list(leaves.values()))
    return Damage(damaged, flipped, bad_values)


class Found(NamedTuple):
    mismatch: dict  # path -> bool per chunk: the digest did not match
    nonfinite: dict  # path -> NaN/Inf count per chunk


def _scan_and_damage(console, args, chunk: int, rng) -> tuple[Any, Damage, Found, float]:
    """The state, scanned once (timed); damaged; verified and scanned again."""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("building the model state", total=4)
        tree = llama_like_tree(jax.random.key(args.seed), args.hidden, args.layers, args.vocab)
        tree = jax.block_until_ready(tree)
        progress.advance(task)
        progress.update(task, description="scanning (digests, finite check)")
        scan = jax.jit(pimhbm.scan_tree, static_argnames="chunk_bytes")
        jax.block_until_ready(scan(tree, chunk_bytes=chunk))  # compile outside the timing
        t0 = time.perf_counter()
        reference = jax.block_until_ready(scan(tree, chunk_bytes=chunk))
        scan_s = time.perf_counter() - t0
        progress.advance(task)
        progress.update(task, description=f"injecting {args.flips} bit flips, "
                                          f"{args.nonfinite} NaN/Inf")
        damage = _damage(tree, rng, args.flips, args.nonfinite)
        progress.advance(task)
        progress.update(task, description="verifying")
        verify = jax.jit(pimhbm.verify_tree, static_argnames="chunk_bytes")
        mismatch = jax.device_get(verify(damage.tree, reference, chunk_bytes=chunk))
        rescan = jax.device_get(scan(damage.tree, chunk_bytes=chunk))
        progress.advance(task)
    found = Found(dict(jax.tree_util.tree_leaves_with_path(mismatch)),
                  {p: r.nonfinite for p, r in jax.tree_util.tree_leaves_with_path(
                      rescan, is_leaf=lambda r: isinstance(r, pimhbm.ScanResult))})
    return tree, damage, found, scan_s


def _chunk_of(tree_leaves: dict, path: Any, index: int, chunk: int) -> int:
    return index * tree_leaves[path].dtype.itemsize // chunk


def _flips_table(console, damage: Damage, found: Found, leaves: dict, chunk: int) -> int:
    """The flips, where they were written and whether their chunk was flagged; how many were."""
    table = Table(title=f"{len(damage.flips)} bit flips: where they were written, where they "
                        "were found")
    for col in ("#", "tensor", "element", "bit", "chunk", "found"):
        table.add_column(col, justify="right" if col in ("#", "element", "bit", "chunk") else "left")
    hits = 0
    for k, (path, index, bit) in enumerate(damage.flips):
        c = _chunk_of(leaves, path, index, chunk)
        hit = bool(found.mismatch[path][c])
        hits += hit
        table.add_row(str(k + 1), _path_str(path), str(index), str(bit), str(c),
                      "[green]yes[/]" if hit else "[red]MISSED[/]")
    console.print(table)
    return hits


def _nonfinite_table(console, damage: Damage, found: Found, leaves: dict, chunk: int) -> int:
    """The NaN/Inf values and the count the rescan found in their chunk; how many were found."""
    table = Table(title=f"{len(damage.bad_values)} NaN/Inf values written into fp32 state")
    for col in ("tensor", "element", "value", "chunk", "non-finite count in chunk"):
        table.add_column(col)
    hits = 0
    for path, index, value in damage.bad_values:
        c = _chunk_of(leaves, path, index, chunk)
        count = int(found.nonfinite[path][c])
        hits += count > 0
        table.add_row(_path_str(path), str(index), str(value), str(c),
                      f"[green]{count}[/]" if count else "[red]0 (MISSED)[/]")
    if damage.bad_values:
        console.print(table)
    return hits


def run(args: Any) -> int:
    console = options.console()
    if args.device:
        jax.config.update("jax_default_device", jax.devices(args.device)[0])
    chunk = args.chunk_bytes or pimhbm.DEFAULT_CHUNK_BYTES
    rng = np.random.default_rng(args.seed)
    device = jax.devices()[0] if not args.device else jax.devices(args.device)[0]
    console.print(f"[bold]pimhbm scan-demo[/] on {device.platform.upper()} ({device.device_kind}), "
                  f"chunks of {chunk} bytes, seed {args.seed}")
    tree, damage, found, scan_s = _scan_and_damage(console, args, chunk, rng)
    leaves = dict(jax.tree_util.tree_leaves_with_path(tree))
    flips_found = _flips_table(console, damage, found, leaves, chunk)
    nonfinite_found = _nonfinite_table(console, damage, found, leaves, chunk)

    # Which chunks should be flagged: the chunk of every flip and of every overwritten value
    # (writing a NaN changes the bytes too); any other flagged chunk is a false alarm.
    expected: dict[Any, set[int]] = {}
    for path, index, _ in damage.flips + damage.bad_values:
        expected.setdefault(path, set()).add(_chunk_of(leaves, path, index, chunk))
    false_alarms = sum(int(np.count_nonzero(m)) - len(expected.get(p, set()) & set(np.flatnonzero(m)))
                       for p, m in found.mismatch.items())
    flagged = sum(int(np.count_nonzero(m)) for m in found.mismatch.values())
    total_chunks = sum(m.size for m in found.mismatch.values())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    n_params = sum(x.size for x in jax.tree.leaves(tree["params"]))
    console.print(
        f"state: {nbytes / 2**20:.1f} MiB in {len(leaves)} tensors ({n_params / 1e6:.1f} M "
        f"parameters), {total_chunks} chunks; scan {scan_s * 1e3:.1f} ms = "
        f"{nbytes / scan_s / 1e9:.2f} GB/s on {device.platform}")
    console.print(f"bit flips found in their chunk: {flips_found}/{len(damage.flips)}; NaN/Inf "
                  f"found: {nonfinite_found}/{len(damage.bad_values)}; chunks flagged: {flagged}; "
                  f"false alarms: {false_alarms}")
    ok = (flips_found == len(damage.flips) and nonfinite_found == len(damage.bad_values) and
          false_alarms == 0)
    console.print("[bold green]verdict: every fault was found in its chunk, no false alarm[/]"
                  if ok else "[bold red]verdict: FAILED (see the tables above)[/]")
    return 0 if ok else 1

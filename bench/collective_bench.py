"""Peer-pointer collectives against JAX's own (NCCL on GPUs), side by side in one run.

For each size from 64 KiB to 1 GiB (the bytes each device ends up with), over every device of
this process: all_gather and all_to_all, ours (one kernel reading peer memory) and jax.lax's.
Reports the median time per call, the bus bandwidth as nccl-tests defines it (size / time *
(n-1)/n) and our time as a ratio of NCCL's (< 1: ours is faster).

usage: python bench/collective_bench.py [--max-mib 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rich.console import Console
from rich.table import Table

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import time_jax, write_json  # noqa: E402

import pimhbm  # noqa: E402


def programs(mesh, op):
    spec = P("x")
    wrap = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                            check_vma=False))
    if op == "all_gather":
        return (wrap(lambda v: pimhbm.peer.all_gather(v, "x", mesh)),
                wrap(lambda v: jax.lax.all_gather(v, "x")))
    return (wrap(lambda v: pimhbm.peer.all_to_all(v, "x", mesh)),
            wrap(lambda v: jax.lax.all_to_all(v, "x", 0, 0)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-mib", type=int, default=1024, help="largest size (default 1024 MiB)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console()
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        console.print("[red]needs 2 or more devices of one platform[/]")
        return 2
    mesh = Mesh(np.array(devices), ("x",))
    sharded = NamedSharding(mesh, P("x"))
    sizes = [64 << 10]
    while sizes[-1] * 4 <= args.max_mib << 20:
        sizes.append(sizes[-1] * 4)
    console.print(f"[bold]peer-pointer collectives vs jax.lax (NCCL)[/] on {n} x "
                  f"{devices[0].device_kind}; NCCL_NVLS_ENABLE="
                  f"{__import__('os').environ.get('NCCL_NVLS_ENABLE', 'unset')}")
    rows = []
    for op in ("all_gather", "all_to_all"):
        ours_fn, nccl_fn = programs(mesh, op)
        table = Table(title=f"{op} over {n} devices")
        for col in ("size/device", "ours us", "NCCL us", "ours GB/s bus", "NCCL GB/s bus", "ours/NCCL"):
            table.add_column(col, justify="right")
        for size in sizes:
            # size = bytes each device holds after the op; the global input holds n times that
            # for all_to_all and once for all_gather (each device contributes size / n).
            elems = size // 4
            total = elems * (n if op == "all_to_all" else 1)
            total -= total % (n * n)
            shape = (n * n, total // (n * n)) if op == "all_to_all" else (total,)
            x = jax.device_put(jnp.arange(total, dtype=jnp.float32).reshape(shape), sharded)
            iters = max(3, min(200, (256 << 20) // size))
            if devices[0].platform == "cpu":
                # Host devices share one thread pool: back-to-back programs that meet their
                # peers can starve each other (XLA's own collectives too); one at a time.
                iters = 1
            ours = time_jax(ours_fn, x, iters=iters, reps=5)
            nccl = time_jax(nccl_fn, x, iters=iters, reps=5)
            same = bool(jnp.array_equal(ours_fn(x), nccl_fn(x)))
            bus = lambda t: size / t * (n - 1) / n / 1e9
            rows.append({"op": op, "bytes": size, "devices": n, "ours_s": ours, "nccl_s": nccl,
                         "ours_busbw_gbs": bus(ours), "nccl_busbw_gbs": bus(nccl),
                         "ratio": ours / nccl, "same_result": same})
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            table.add_row(label + ("" if same else " [red]DIFFERENT[/]"), f"{ours * 1e6:.1f}",
                          f"{nccl * 1e6:.1f}", f"{bus(ours):.1f}", f"{bus(nccl):.1f}",
                          f"{ours / nccl:.2f}x")
            del x
        console.print(table)
    wins = [r for r in rows if r["ratio"] < 1]
    console.print(f"ours faster at {len(wins)} of {len(rows)} (op, size) points: " +
                  ", ".join(f"{r['op']} {r['bytes'] >> 10} KiB" for r in wins))
    write_json(args.json, {"devices": n, "kind": devices[0].device_kind, "rows": rows})
    return 0 if all(r["same_result"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Repair from a healthy replica, both transports side by side in one run: XLA's collectives
(a psum inside a pre-compiled program) and the one-sided peer pull (our kernel reads the source
GPU's memory; no NCCL call). For one chunk (latency: call -> chunk verified on every device)
and for a whole shard (every chunk of a tensor; bandwidth).

usage: python bench/replica_bench.py [--mib 1024] [--json out.json]
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
from common import time_replica_repair, write_json  # noqa: E402

import pimhbm  # noqa: E402
from pimhbm import replica  # noqa: E402

CHUNK = 16384  # bytes per chunk (4096 fp32 elements, as the trainer's state)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="shard size per device (default 1024)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console()
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        console.print("[red]needs 2 or more devices[/]")
        return 2
    mesh = Mesh(np.array(devices), ("dp",))
    sh, rep = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
    elems = (args.mib << 20) // 4
    nch = -(-elems * 4 // CHUNK)
    console.print(f"[bold]repair from a replica[/]: {args.mib} MiB fp32 shard per device, chunks of "
                  f"{CHUNK} B ({nch} chunks), {n} x {devices[0].device_kind}")
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n * elems,), jnp.float32), sh)
    # Every device holds the same shard: device 0's copied to all.
    x = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "dp")[0], mesh=mesh,
                              in_specs=P("dp"), out_specs=P("dp"), check_vma=False))(x)
    table = jax.jit(jax.shard_map(lambda v: pimhbm.scan(v, CHUNK).digests, mesh=mesh,
                                  in_specs=P("dp"), out_specs=P("dp"), check_vma=False))(x)

    def program(body, k):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp"), P(), P()),
                           out_specs=(P("dp"), P("dp"), P("dp")), check_vma=False)
        return jax.jit(fn, donate_argnums=(0, 1))

    def peer(v, t, lists, srcs):
        (v, t), status = pimhbm.peer.pull(lists, srcs, (v, t), CHUNK, "dp", mesh)
        return v, t, status[None]

    def collective(v, t, lists, srcs):
        (v, t), status = replica.pull_collective(lists, srcs, (v, t), CHUNK, "dp")
        return v, t, status[None]

    def whole_collective(v, t, lists, srcs):  # the trainer's rebuild: every byte in one psum
        take = jax.lax.axis_index("dp") != 0
        v = replica.copy_whole(v, jnp.int32(0), take, "dp")
        t = replica.copy_whole(t, jnp.int32(0), take, "dp")
        bad = jnp.sum(pimhbm.verify(v, t, CHUNK), dtype=jnp.int32)
        return v, t, jnp.where(take & (bad == 0), pimhbm.REPAIRED, pimhbm.NOT_LISTED)[None, None]

    results = []
    state = [x, table]

    def measure(name, fn, lists, reps):
        lists = jax.device_put(np.asarray(lists, np.int32), rep)
        srcs = jax.device_put(np.zeros(lists.shape, np.int32), rep)
        return time_replica_repair(fn, state, lists, srcs, reps)

    table_out = Table(title=f"repair from a replica, {n} devices")
    for col in ("what", "transport", "ms", "GB/s", "verified"):
        table_out.add_column(col, justify="left" if col in ("what", "transport") else "right")
    one = [int(np.random.default_rng(1).integers(0, nch))]
    for what, lists, bodies in (
            ("one chunk", one, (("collective (psum)", collective), ("peer pull", peer))),
            ("whole shard", list(range(nch)), (("collective (psum)", whole_collective),
                                               ("peer pull", peer)))):
        for transport, body in bodies:
            fn = program(body, len(lists))
            seconds, ok = measure(what, fn, lists, 15 if what == "one chunk" else 5)
            moved = len(lists) * CHUNK if what == "one chunk" else elems * 4
            results.append({"what": what, "transport": transport, "seconds": seconds,
                            "bytes": moved, "verified": ok})
            table_out.add_row(what, transport, f"{seconds * 1e3:.3f}",
                              f"{moved / seconds / 1e9:.1f}", "yes" if ok else "[red]NO[/]")
    console.print(table_out)
    write_json(args.json, {"devices": n, "kind": devices[0].device_kind, "mib": args.mib,
                           "rows": results})
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

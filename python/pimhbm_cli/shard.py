"""``pimhbm shard``: a mesh over the available devices, a model state sharded over it, and the
digests of every device's shard (computed on the device that holds it)."""

from __future__ import annotations

from typing import Any

from pimhbm_cli import options
from pimhbm_cli.options import positive_int


def add_arguments(p) -> None:
    p.add_argument("--rows", type=positive_int, default=4096, help="rows of the sharded tensor")
    p.add_argument("--cols", type=positive_int, default=1024, help="columns of the sharded tensor")
    p.add_argument("--chunk-bytes", type=positive_int, default=65536,
                   help="digest chunk size in bytes (a multiple of 16)")


def run(args: Any) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from rich.table import Table

    import pimhbm

    console = options.console()
    devices = jax.devices()
    n = len(devices)
    if args.rows % n:
        console.print(f"[red]--rows must divide over {n} devices[/]")
        return 2
    mesh = Mesh(np.array(devices), ("shard",))
    state = {"w_in": jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.bfloat16),
             "w_out": jax.random.normal(jax.random.key(1), (args.rows, args.cols), jnp.float32)}
    state = jax.device_put(state, NamedSharding(mesh, P("shard")))
    scan = jax.jit(jax.shard_map(lambda t: pimhbm.scan_tree(t, args.chunk_bytes), mesh=mesh,
                                 in_specs=P("shard"), out_specs=P("shard")))
    results = scan(state)
    console.print(f"mesh: {n} device(s) {[d.id for d in devices]} along 'shard'; each holds "
                  f"{args.rows // n} rows of every tensor")
    table = Table(title="per-shard digests (first chunk), chunks and NaN/Inf by device")
    for col in ("device", "tensor", "shard", "chunks", "first digest", "NaN/Inf"):
        table.add_column(col)
    ok = True
    for name, r in results.items():
        per = r.digests.shape[0] // n
        digests = np.asarray(r.digests)
        nonfinite = np.asarray(r.nonfinite)
        for d in range(n):
            shard = state[name].addressable_shards[d]
            # Checked here against the same digest computed from the host copy of the shard.
            host = pimhbm.scan(jax.device_put(np.asarray(shard.data), jax.devices("cpu")[0]),
                               args.chunk_bytes).digests
            ok &= np.array_equal(np.asarray(host), digests[d * per:(d + 1) * per])
            lo, hi = digests[d * per]
            table.add_row(str(shard.device.id), name, str(tuple(shard.data.shape)), str(per),
                          f"{hi:08x}{lo:08x}", str(int(nonfinite[d * per:(d + 1) * per].sum())))
    console.print(table)
    console.print("every shard's digests equal the host's recomputation" if ok else
                  "[red]a shard's digests differ from the host's recomputation[/]")
    return 0 if ok else 1

"""Repair from a healthy replica in another process (one process per GPU, jax.distributed on
localhost), both transports side by side in one run: XLA's collectives (a psum inside a
pre-compiled program, as the trainer's "collective" transport) and the one-sided CUDA IPC pull
(process 1 maps process 0's memory and our kernel reads it; the round's agreement goes through
jax.distributed's key-value store, as the trainer's "ipc" transport). For one chunk (latency:
call -> chunk verified, every process agreed) and for a whole shard (every chunk; bandwidth).
Where CUDA IPC is unavailable (CPU devices) its rows say why.

usage: python bench/replica_processes_bench.py [--processes 2] [--mib 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

CHUNK = 16384  # bytes per chunk (4096 fp32 elements, as the trainer's state)


def launch(args: argparse.Namespace) -> int:
    """Starts --processes copies of this script (each with its id and the coordinator's
    address); the exit code is the worst of theirs. Every wait is bounded."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--process-id", str(i),
                               "--coordinator", f"localhost:{port}"]) for i in range(args.processes)]
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            print(f"process {procs.index(p)} did not finish in {args.timeout} s: stopped",
                  file=sys.stderr)
            p.kill()
            p.wait()
    return max((p.returncode for p in procs), key=abs)


def worker(args: argparse.Namespace) -> int:
    import jax

    gpu = not os.environ.get("JAX_PLATFORMS", "").startswith("cpu")
    if gpu:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id,
                                   local_device_ids=[args.process_id], initialization_timeout=120,
                                   coordinator_bind_address=args.coordinator)
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id,
                                   initialization_timeout=120,
                                   coordinator_bind_address=args.coordinator)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import time_replica_repair, write_json

    import pimhbm
    from pimhbm import ipc, replica

    lead = jax.process_index() == 0
    console = Console(quiet=not lead)
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("dp",))
    sh, rep = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
    elems = (args.mib << 20) // 4
    nch = -(-elems * 4 // CHUNK)
    console.print(f"[bold]repair from a replica in another process[/]: {args.mib} MiB fp32 shard "
                  f"per device, chunks of {CHUNK} B ({nch} chunks), {n} x "
                  f"{devices[0].device_kind}, {jax.process_count()} processes")
    # Every device holds the same shard (the same seeded host data in every process).
    host = np.random.default_rng(0).standard_normal(elems, dtype=np.float32)
    x = jax.make_array_from_callback((n * elems,), sh, lambda idx: host[:elems])
    digests = jax.jit(jax.shard_map(lambda v: pimhbm.scan(v, CHUNK).digests, mesh=mesh,
                                    in_specs=P("dp"), out_specs=P("dp"), check_vma=False))
    state = [x, digests(x)]

    def program(body):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp"), P(), P()),
                           out_specs=(P("dp"), P("dp"), P()), check_vma=False)
        return jax.jit(fn, donate_argnums=(0, 1))

    def collective(v, t, lists, srcs):  # the trainer's collective transport, one tensor
        (v, t), status = replica.pull_collective(lists, srcs, (v, t), CHUNK, "dp")
        return v, t, jax.lax.all_gather(status, "dp")

    def whole_collective(v, t, lists, srcs):  # the trainer's rebuild: every byte in one psum
        take = jax.lax.axis_index("dp") != 0
        v = replica.copy_whole(v, jnp.int32(0), take, "dp")
        t = replica.copy_whole(t, jnp.int32(0), take, "dp")
        bad = jnp.sum(pimhbm.verify(v, t, CHUNK), dtype=jnp.int32)
        status = jnp.where(take & (bad == 0), pimhbm.REPAIRED, pimhbm.NOT_LISTED)
        return v, t, jax.lax.all_gather(status[None], "dp")

    def time_collective(body, lists, reps):
        fn = program(body)
        lists = jax.device_put(np.asarray(lists, np.int32), rep)
        srcs = jax.device_put(np.zeros(lists.shape, np.int32), rep)
        # The statuses are gathered on every device: this process's copy holds all of them.
        seconds, ok = time_replica_repair(fn, state, lists, srcs, reps,
                                          lambda s: np.asarray(s.addressable_shards[0].data))
        return seconds, ok, ""

    rounds = iter(range(1, 1 << 30))

    def time_ipc(lists, reps):
        pulls = [ipc.Pull(f"x.{target}", devices[0], devices[target], list(lists),
                          (state[0], state[1]), (state[0], state[1]), CHUNK)
                 for target in range(1, n)]
        samples = []
        for r in range(reps + 2):
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            try:
                pulled = ipc.run_round("bench", next(rounds), pulls, 30_000)
            except ipc.Unavailable as err:
                return float("nan"), False, f"unavailable: {err}"
            except RuntimeError as err:
                return float("nan"), False, f"failed: {err}"
            if r >= 2:
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples), pulled == len(lists) * (n - 1), ""

    results = []
    one = [int(np.random.default_rng(1).integers(0, nch))]
    for what, lists, runs in (
            ("one chunk", one, (("collective (psum)", lambda: time_collective(collective, one, 15)),
                                ("CUDA IPC pull", lambda: time_ipc(one, 15)))),
            ("whole shard", list(range(nch)),
             (("collective (psum)", lambda: time_collective(whole_collective, [0], 5)),
              ("CUDA IPC pull", lambda: time_ipc(list(range(nch)), 5))))):
        for transport, run in runs:
            seconds, ok, note = run()
            # Each process's own figure; the slowest is the one the run waits for.
            seconds = float(np.max(multihost_utils.process_allgather(np.float64(seconds))))
            moved = len(lists) * CHUNK if what == "one chunk" else elems * 4
            results.append({"what": what, "transport": transport,
                            "seconds": None if note else seconds,
                            "bytes": moved, "verified": ok, "note": note})
    ok_all = multihost_utils.process_allgather(np.array([r["verified"] or bool(r["note"])
                                                         for r in results]))
    t = Table(title=f"repair from a replica in another process, {n} devices")
    for col in ("what", "transport", "ms", "GB/s", "verified"):
        t.add_column(col, justify="left" if col in ("what", "transport") else "right")
    for r in results:
        ms = "-" if r["note"] else f"{r['seconds'] * 1e3:.3f}"
        bw = "-" if r["note"] else f"{r['bytes'] / r['seconds'] / 1e9:.1f}"
        t.add_row(r["what"], r["transport"], ms, bw,
                  r["note"][:60] if r["note"] else ("yes" if r["verified"] else "[red]NO[/]"))
    console.print(t)
    if lead:
        write_json(args.json, {"devices": n, "processes": jax.process_count(),
                               "kind": devices[0].device_kind, "mib": args.mib, "rows": results})
    pimhbm._core.ipc_close()
    jax.distributed.shutdown()
    return 0 if ok_all.all() else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2, help="processes, one GPU each (default 2)")
    ap.add_argument("--mib", type=int, default=1024, help="shard size per device (default 1024)")
    ap.add_argument("--timeout", type=float, default=300, help="bound on the whole run, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.processes < 2:
        print("--processes must be 2 or more", file=sys.stderr)
        return 2
    return launch(args) if args.process_id is None else worker(args)


if __name__ == "__main__":
    sys.exit(main())

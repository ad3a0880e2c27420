"""Recovery on the GPU, in one run: how fast a damaged chunk is repaired from the device copy,
how fast a whole shard is restored from the device copy and from the host snapshot, and how a
resume from shared memory compares with an orbax restore of the same state from local disk.

usage: python bench/recovery_bench.py [--gib 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402

import pimhbm  # noqa: E402
from pimhbm import _core  # noqa: E402
from pimhbm.backup import HostBackup, specs_of  # noqa: E402

CHUNK = 16384  # bytes per chunk of the fp32 tensors (4096 elements, as with a device copy)


def median_seconds(fn, reps=21):
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console(width=120)
    dev = jax.devices()[0]
    n = int(args.gib * 2**30) // 4 // 3  # three fp32 tensors: parameters and two moments
    state = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(3)]
    tables = [pimhbm.scan(t, CHUNK).digests for t in state]
    device_copy = [jnp.copy(t) for t in state]
    jax.block_until_ready((state, tables, device_copy))
    nbytes = sum(t.nbytes for t in state)
    res = {"device": dev.device_kind, "state_bytes": nbytes}

    # 1. One damaged chunk: repaired from the device copy, verified, status back on the host.
    repair = jax.jit(lambda c, s, st, d, dt: pimhbm.repair(c, (s, st), (d, dt), CHUNK),
                     donate_argnums=(3, 4))
    target, target_table = jnp.copy(state[0]), jnp.copy(tables[0])
    one = jax.device_put(np.array([min(12345, tables[0].shape[0] - 1)], np.int32))

    def repair_one():
        nonlocal target, target_table
        (target, target_table), status = repair(one, device_copy[0], tables[0], target, target_table)
        assert int(np.asarray(status)[0]) == pimhbm.REPAIRED

    res["chunk_repair_ms"] = median_seconds(repair_one) * 1e3

    # 2. A whole shard (every chunk of a tensor) restored from the device copy, each chunk
    #    verified before and after the copy.
    every = jax.device_put(np.arange(tables[0].shape[0], dtype=np.int32))

    def restore_shard():
        nonlocal target, target_table
        (target, target_table), status = repair(every, device_copy[0], tables[0], target, target_table)
        jax.block_until_ready(status)

    t = median_seconds(restore_shard, reps=5)
    res["shard_from_device_copy_GBps"] = state[0].nbytes / t / 1e9

    # 3. Host snapshot into shared memory (side stream), then restore and verify from it.
    name = f"pimhbm_bench_{uuid.uuid4().hex[:8]}"
    named = [(f"t{i}", t) for i, t in enumerate(state)] + [(f"d{i}", d) for i, d in enumerate(tables)]
    backup = HostBackup(name, specs_of(named), specs_of([("x", np.zeros(1, np.int32))]), ring=1,
                        create=True)
    try:
        res["region_pinned"] = backup.pinned
        snap = jax.jit(lambda *xs: pimhbm.backup_snapshot(list(xs), backup.region, backup.offsets(0)))
        arrays = [a for _, a in named]

        def snapshot():
            jax.block_until_ready(snap(*arrays))
            _core.snapshot_wait()

        t = median_seconds(snapshot, reps=3)
        res["snapshot_GBps"] = nbytes / t / 1e9
        backup.complete(0)
        backup.close()  # the restores below open it again, one handle at a time
        verify = jax.jit(lambda x, d: jnp.any(pimhbm.verify(x, d, CHUNK)))

        phases = {"map": [], "put": [], "verify": [], "pin": [], "lock_first": [],
                  "put_locked": [], "put_threads": []}

        def restore_from_host():
            # What a new process does: map the region, put the snapshot on the device from
            # NumPy views of its pageable pages, verify it there (the resume); then page-lock
            # the region in the background for the next snapshot (reported beside it).
            t0 = time.perf_counter()
            reopened = HostBackup(name, backup.tensors, backup.batch, ring=1, create=False)
            views = reopened.snapshot_arrays(0)
            t1 = time.perf_counter()
            on_device = [jax.device_put(v, dev) for v in views]
            jax.block_until_ready(on_device)
            t2 = time.perf_counter()
            bad = [verify(x, d) for x, d in zip(on_device[:3], on_device[3:])]
            assert not any(bool(b) for b in bad)
            t3 = time.perf_counter()
            reopened.pin_rest_in_background()
            reopened.wait_pinned()
            t4 = time.perf_counter()
            reopened.close()
            # The other way, for comparison: page-lock the region first, then put.
            locked = HostBackup(name, backup.tensors, backup.batch, ring=1, create=False)
            t5 = time.perf_counter()
            locked.wait_pinned()
            arrays = locked.snapshot_arrays(0)
            t6 = time.perf_counter()
            jax.block_until_ready([jax.device_put(v, dev) for v in arrays])
            t7 = time.perf_counter()
            locked.close()
            # And the pageable put with the arrays put from several threads at once.
            again = HostBackup(name, backup.tensors, backup.batch, ring=1, create=False)
            t8 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                jax.block_until_ready(list(pool.map(lambda v: jax.device_put(v, dev),
                                                    again.snapshot_arrays(0))))
            t9 = time.perf_counter()
            again.close()
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6,
                                     t9 - t8)):
                phases[k].append(v)
            return t3 - t0

        samples = [restore_from_host() for _ in range(4)][1:]  # the first compiles `verify`
        t = statistics.median(samples)
        res["shard_from_host_GBps"] = nbytes / t / 1e9
        res["resume_seconds"] = t
        # Where the resume's time goes (medians): mapping the region, the host-to-device puts,
        # the verification on the device; and when the background pinning was done.
        for k, v in phases.items():
            res[f"resume_{k}_seconds"] = statistics.median(v[1:])

        # 4. orbax: the same state saved to local disk and restored (page cache dropped first
        #    when the machine allows it).
        try:
            import orbax.checkpoint as ocp
            folder = tempfile.mkdtemp(prefix="pimhbm_orbax_")
            path = os.path.join(folder, "ckpt")
            ckpt = ocp.StandardCheckpointer()
            tree = {k: a for k, a in named}
            t0 = time.perf_counter()
            ckpt.save(path, tree)
            ckpt.wait_until_finished()
            res["orbax_save_seconds"] = time.perf_counter() - t0
            res["orbax_page_cache_dropped"] = drop_page_cache()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
            t0 = time.perf_counter()
            restored = ckpt.restore(path, abstract)
            jax.block_until_ready(restored)
            res["orbax_restore_seconds"] = time.perf_counter() - t0
            shutil.rmtree(folder, ignore_errors=True)
        except Exception as e:  # orbax missing or failing: say so, keep the other figures
            res["orbax_error"] = f"{type(e).__name__}: {e}"
    finally:
        HostBackup.unlink(name)

    table = Table(title=f"recovery, {nbytes / 2**30:.1f} GiB of state, {dev.device_kind}")
    table.add_column("what")
    table.add_column("figure", justify="right")
    table.add_row("one chunk repaired from the device copy (fault reported -> verified)",
                  f"{res['chunk_repair_ms']:.3f} ms")
    table.add_row("a whole tensor restored from the device copy", f"{res['shard_from_device_copy_GBps']:.1f} GB/s")
    table.add_row("host snapshot into shared memory (side stream)", f"{res['snapshot_GBps']:.1f} GB/s")
    table.add_row("state restored from the host snapshot (+ verified)", f"{res['shard_from_host_GBps']:.1f} GB/s")
    table.add_row("resume from shared memory", f"{res['resume_seconds']:.3f} s")
    table.add_row("  of which: map the region / put on the device / verify",
                  f"{res['resume_map_seconds']:.3f} / {res['resume_put_seconds']:.3f} / "
                  f"{res['resume_verify_seconds']:.3f} s")
    table.add_row("  then the region page-locked (background, for the next snapshot)",
                  f"{res['resume_pin_seconds']:.3f} s")
    table.add_row("  (for comparison: page-lock the region first / put from it)",
                  f"{res['resume_lock_first_seconds']:.3f} / {res['resume_put_locked_seconds']:.3f} s")
    table.add_row("  (for comparison: the put from 8 threads, one array each)",
                  f"{res['resume_put_threads_seconds']:.3f} s")
    if "orbax_restore_seconds" in res:
        table.add_row("orbax restore from local disk" +
                      ("" if res["orbax_page_cache_dropped"] else " (page cache warm)"),
                      f"{res['orbax_restore_seconds']:.3f} s")
        res["resume_speedup_vs_orbax"] = res["orbax_restore_seconds"] / res["resume_seconds"]
        table.add_row("resume speed-up over orbax", f"{res['resume_speedup_vs_orbax']:.1f}x")
    else:
        table.add_row("orbax", res.get("orbax_error", "-"))
    console.print(table)
    console.print(f"chunk repair < 1 ms: {'[green]met[/]' if res['chunk_repair_ms'] < 1 else '[red]not met[/]'}; "
                  "resume >= 10x faster than orbax: " +
                  ("[green]met[/]" if res.get("resume_speedup_vs_orbax", 0) >= 10 else "[red]not met[/]"))
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

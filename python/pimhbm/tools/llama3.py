"""``pimhbm llama3``: Llama-3-8B-dimension layers trained under protection on a GPU.

Measures the step time with full protection (digests checked and rewritten in the update pass,
commit-or-skip on the device, the device copy kept current, the fault summary read one step
later) against the same step with plain ``optax.adamw``, then runs a fault campaign at this
scale and checks that it ends bit-identical to the same run without faults.

Bit-identical replays need a deterministic step: on GPUs run with
XLA_FLAGS=--xla_gpu_deterministic_ops=true (``--deterministic`` sets it; its own cost is
reported apart, it is not the cost of protection).

``--processes N`` runs the same job as N processes of one host, the way clusters run it: each
process drives its share of the devices (one GPU each on a GPU machine), they meet through
``jax.distributed`` on a localhost coordinator, and process 0 prints and writes the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np


def add_arguments(p) -> None:
    p.add_argument("--layers", type=int, default=2, help="decoder layers of 8B dimensions (default 2)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (default 16384)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--vocab", type=int, default=8192,
                   help="vocabulary (default 8192: the layers, not the LM head, are measured)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--campaign-steps", type=int, default=30, help="steps of the fault campaign")
    p.add_argument("--faults", type=int, default=2, help="faults of each kind in the campaign")
    p.add_argument("--no-campaign", action="store_true", help="only the timings")
    p.add_argument("--deterministic", action="store_true",
                   help="set XLA_FLAGS=--xla_gpu_deterministic_ops=true (needed for bit-identical "
                        "replays on GPUs)")
    p.add_argument("--devices", type=int, default=1,
                   help="data parallel over this many GPUs (default 1); both steps sharded alike")
    p.add_argument("--shard", type=int, default=1,
                   help="FSDP: each replica's parameters split over this many devices (default 1)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny configuration of the same code instead of 8B dimensions (a "
                        "check of the tool on a CPU)")
    p.add_argument("--replica-transport", choices=("collective", "peer", "ipc"), default="collective",
                   help="how a chunk is pulled from a healthy replica (several devices): an XLA "
                        "collective, our kernel reading a peer GPU of this process (peer), or "
                        "of another process over CUDA IPC (ipc, with --processes)")
    p.add_argument("--no-device-copy", action="store_true",
                   help="keep no device copy of the state: every damaged chunk is pulled from "
                        "another replica (needs more devices than --shard); the update writes "
                        "12 bytes a parameter less with bf16 parameters and fp32 master weights")
    p.add_argument("--processes", type=int, default=1,
                   help="run as this many processes (jax.distributed on localhost), the devices "
                        "split evenly between them (default 1: one process sees them all)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also trace 6 steps of each kind with jax.profiler into DIR and print "
                        "where the device time goes (kernels by kind, the largest ones)")
    # Set by the launcher for each process of a --processes run.
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)


def _gpu_count() -> int:
    """GPUs on this machine, asked of nvidia-smi (the launcher must not start a JAX backend)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _launch(args: Any) -> int:
    """Starts --processes copies of this command, each with its process id and the
    coordinator's address, and waits for all of them; the exit code is the worst of theirs."""
    n = args.processes
    if args.devices % n:
        print(f"--devices {args.devices} must split evenly over --processes {n}", file=sys.stderr)
        return 2
    gpus = _gpu_count()
    if gpus and gpus < args.devices:
        print(f"--devices {args.devices}: this machine has {gpus} GPUs", file=sys.stderr)
        return 2
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    argv = list(args.argv)  # this command as given (pimhbm.cli keeps it)
    env = dict(os.environ)
    if not gpus:  # CPU devices: each process makes its share of them
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count="
                                             f"{args.devices // n}"])
    procs = [subprocess.Popen([sys.executable, "-m", "pimhbm.cli", *argv, "--process-id", str(i),
                               "--coordinator", f"localhost:{port}"], env=env)
             for i in range(n)]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


ROUNDS = 5  # timed rounds of each step, alternating plain and protected


def _tally_since(before: dict, after: dict) -> dict:
    """What ``pimhbm._core.unaliased_copies_by_op()`` counted between two readings, by op."""
    out = {}
    for op, t in after.items():
        d = {k: v - before.get(op, {}).get(k, 0) for k, v in t.items()}
        if d["results"]:
            out[op] = d
    return out


def _timed_round(fn) -> float:
    """Seconds ``fn`` takes (it runs a round of steps and waits for them)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


PROFILE_STEPS = 6  # steps traced of each kind (fewer when --steps is smaller)


def _print_profile(console, traces, results, steps: int, out_dir: str) -> None:
    """Device time per step by kind of kernel, plain against protected; where each device's
    wall time goes (busy, idle, collectives not hidden under compute); and the largest kernels
    of both steps (matmuls left out: the same in both); each step's kernels in order into
    ``out_dir``/KIND_timeline.json.gz. ``traces``: kind -> trace path."""
    import jax
    from rich.table import Table

    from pimhbm.tools import device_profile
    profiles = {k: device_profile.device_events(p) for k, p in traces.items()}
    sums = {k: device_profile.summary(ev, steps) for k, ev in profiles.items()}
    results["profile_ms_per_step"] = sums
    t = Table(title="device time per step (ms), from the profiler")
    for col in ("kernels", "plain", "protected", "difference"):
        t.add_column(col, justify="left" if col == "kernels" else "right")
    for cat in sorted(set(sums["plain"]) | set(sums["protected"]), key=lambda c: c == "total"):
        a, b = sums["plain"].get(cat, 0.0), sums["protected"].get(cat, 0.0)
        t.add_row(cat, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}")
    console.print(t)
    if not profiles["protected"]:
        console.print("(the trace holds no device timeline: nothing to split)")
        return
    for kind, path in traces.items():
        # Each process traced its own devices: its own file (the lead's keeps the plain name).
        rank = jax.process_index()
        out = os.path.join(out_dir, f"{kind}_timeline{f'.{rank}' if rank else ''}.json.gz")
        n = device_profile.write_timeline(path, out)
        console.print(f"{kind} step: {n} device kernels of {steps} steps -> {out}")
    walls = {k: device_profile.overlap(p, steps) for k, p in traces.items()}
    results["profile_wall_ms_per_step"] = walls
    t = Table(title="a device's wall time per step (ms), from the profiler's timeline")
    for col in ("", "plain", "protected", "difference"):
        t.add_column(col, justify="left" if not col else "right")
    for key in ("span", "busy", "idle", "collectives", "collectives exposed"):
        a, b = walls["plain"][key], walls["protected"][key]
        t.add_row(key, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}")
    console.print(t)
    for kind in ("plain", "protected"):
        t = Table(title=f"largest kernels of the {kind} step, matmuls left out (ms per step)")
        for col in ("kernel", "XLA op", "ms", "launches"):
            t.add_column(col, justify="left" if col in ("kernel", "XLA op") else "right")
        rows = device_profile.top_kernels(profiles[kind], steps,
                                          n=15 if kind == "protected" else 10)
        results[f"profile_top_{kind}"] = rows
        for name, op, ms, n in rows:
            t.add_row(name, op, f"{ms:.3f}", str(n))
        console.print(t)
    for kind in ("plain", "protected"):
        t = Table(title=f"collectives of the {kind} step, most exposed first (ms per step; "
                        "'at': mean start as a fraction of the step)")
        for col in ("XLA op", "launches", "ms", "exposed", "at"):
            t.add_column(col, justify="left" if col == "XLA op" else "right")
        rows = device_profile.collectives(traces[kind], steps)
        results[f"profile_collectives_{kind}"] = rows
        for op, n, ms, exp, at in rows:
            t.add_row(op, str(n), f"{ms:.3f}", f"{exp:.3f}", f"{at:.2f}")
        console.print(t)


def run(args: Any) -> int:
    if args.processes < 1:
        print("--processes must be at least 1", file=sys.stderr)
        return 2
    if ((args.replica_transport == "ipc" and args.processes < 2) or
            (args.replica_transport == "peer" and args.processes > 1)):
        print(f"--replica-transport {args.replica_transport}: 'ipc' pulls across processes "
              "(--processes 2 or more), 'peer' within one process", file=sys.stderr)
        return 2
    if args.no_device_copy and args.devices <= args.shard:
        print(f"--no-device-copy repairs from other replicas: it needs more devices than "
              f"--shard ({args.devices} devices, --shard {args.shard})", file=sys.stderr)
        return 2
    if args.processes > 1 and args.process_id is None:
        return _launch(args)
    if args.deterministic and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_gpu_deterministic_ops=true").strip()
    import jax
    if args.process_id is not None:  # one process of a --processes run
        per = args.devices // args.processes
        if _gpu_count():
            jax.distributed.initialize(args.coordinator, args.processes, args.process_id,
                                       local_device_ids=list(range(args.process_id * per,
                                                                   (args.process_id + 1) * per)),
                                       initialization_timeout=120)
        else:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(args.coordinator, args.processes, args.process_id,
                                       initialization_timeout=120)
    import jax.numpy as jnp
    import optax
    from rich.console import Console
    from rich.table import Table

    import pimhbm
    from pimhbm.backup import HostBackup
    from pimhbm.campaign import KINDS, Campaign, unlocated_note
    from pimhbm.models import llama3
    from pimhbm.recovery import fsdp_spec
    from pimhbm.tools import device_profile
    from pimhbm.train import llama_trainer, warmup_cosine

    lead = jax.process_index() == 0  # prints and writes the figures
    console = Console(quiet=not lead)
    if args.devices < 1 or args.devices > len(jax.devices()):
        console.print(f"[red]--devices {args.devices}: this machine has {len(jax.devices())}[/]")
        return 2
    devices = jax.devices()[:args.devices]
    dev = jax.local_devices()[0]  # this process's first device (memory figures)
    if args.shard < 1 or args.devices % args.shard:
        console.print(f"[red]--shard {args.shard} must divide --devices {args.devices}[/]")
        return 2
    P = jax.sharding.PartitionSpec

    def put(x, sharding):
        """A host value onto a (possibly several-process) sharding: each process fills its own
        devices' parts of the same value."""
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, args.shard), ("dp", "shard"))
    replicated = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P(("dp", "shard")))
    # The plain step sharded as the protected one: FSDP leaves split on their first dimension.
    fsdp = lambda x: jax.sharding.NamedSharding(mesh, fsdp_spec(x.shape, args.shard))
    if args.tokens % args.seq or (args.tokens // args.seq) % args.devices:
        console.print("[red]--tokens must be a multiple of --seq, in sequences that split "
                      "evenly over --devices[/]")
        return 2
    batch = args.tokens // args.seq
    cfg = (llama3.tiny(layers=args.layers, vocab=args.vocab) if args.tiny else
           llama3.llama3_8b(layers=args.layers, vocab=args.vocab))
    # cuDNN's fused attention on GPUs, except in exact-replay mode: with XLA's deterministic-ops
    # flag this XLA fails to look up the compiled cuDNN graph (an IndexError from
    # raw_hash_map::at; openxla/xla#46500), so both steps use XLA's own attention there.
    deterministic = "deterministic_ops=true" in os.environ.get("XLA_FLAGS", "")
    attention = "cudnn" if dev.platform == "gpu" and not deterministic else "xla"
    console.print(f"[bold]pimhbm llama3[/]: {args.layers} {'tiny' if args.tiny else 'Llama-3-8B'} "
                  f"layers (hidden {cfg.hidden}, intermediate {cfg.intermediate}, GQA "
                  f"{cfg.heads}/{cfg.kv_heads}, head {cfg.head_dim}), vocab {args.vocab}, "
                  f"{cfg.num_params() / 1e6:.0f} M parameters (bf16, fp32 master and moments), "
                  f"{batch} x {args.seq} = {args.tokens} tokens a step, on {len(devices)} x "
                  f"{dev.device_kind} ({len(devices) // args.shard} replicas x {args.shard} "
                  f"shards; {jax.process_count()} process(es)); "
                  f"deterministic ops: {'on' if deterministic else 'off'}")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=4_000_000, dtype=np.uint8).tobytes()  # random bytes
    lr_of = warmup_cosine(3e-4, 5, 1000)
    results: dict[str, Any] = {"device": dev.device_kind, "devices": len(devices),
                               "processes": jax.process_count(),
                               "shard": args.shard, "tiny": args.tiny,
                               "replica_transport": args.replica_transport, "layers": args.layers,
                               "device_copy": not args.no_device_copy,
                               "tokens": args.tokens, "params": cfg.num_params()}

    # Plain: optax.adamw on fp32 master weights, bf16 parameters cast from them.
    fresh = lambda: llama3.init(jax.random.key(0), cfg)  # the same weights every time
    params = jax.tree.map(lambda p: put(p, fsdp(p)), fresh())
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4, weight_decay=0.01)

    @functools.partial(jax.jit, donate_argnums=0)
    def plain_step(state, b, lr):
        master, opt, params = state
        opt.hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(lambda p: llama3.loss(p, b, cfg, attention))(params)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt = tx.update(grads, opt, master)
        master = optax.apply_updates(master, updates)
        return master, opt, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)

    from pimhbm.train import text_batches
    batch_fn = text_batches(data, batch, args.seq, 0)
    batches = [jax.tree.map(lambda x: put(x, split), batch_fn(s + 1)) for s in range(args.steps)]
    lrs = [put(np.float32(lr_of(s + 1)), replicated) for s in range(args.steps)]
    console.print("compiling the unprotected step (optax.adamw) ...")
    opt0 = jax.jit(tx.init)(master)  # moments follow the master weights' sharding
    carry = plain_step((master, opt0, params), batches[0], lrs[0])
    jax.block_until_ready(carry)
    del master, opt0, params  # donated
    # The plain step's state (14 bytes a parameter) stays on the devices beside the protected
    # one until both are timed (rounds in turn): at most ~3x the protected state's memory.

    def plain_round(steps: int) -> None:
        nonlocal carry
        for b, lr in zip(batches[:steps], lrs[:steps]):
            carry = plain_step(carry, b, lr)
        jax.block_until_ready(carry)

    profiles = {}
    profile_steps = min(PROFILE_STEPS, len(batches))

    # Protected: the recovery engine's step (fault hooks compiled in, as in the campaign).
    name = f"pimhbm_llama3_{uuid.uuid4().hex[:8]}"
    trainer = llama_trainer(cfg, data, steps=1000, batch=batch, seq=args.seq, peak_lr=3e-4,
                            warmup=5, chunk_elems=4096, shm_name=name, snapshot_every=0,
                            scrub_every=0, inject_gradients=True, devices=devices,
                            attention_impl=attention, params=fresh(),
                            replica_transport=args.replica_transport, shard=args.shard,
                            device_copy=not args.no_device_copy)
    try:
        console.print("prewarm (every program, from shapes) ...")
        before = dev.memory_stats() or {}
        pre = trainer.prewarm()
        after = dev.memory_stats() or {}
        results["prewarm_seconds"] = pre["seconds"]
        results["prewarm_device_bytes"] = (after.get("bytes_in_use", 0) - before.get("bytes_in_use", 0)
                                           if before else None)
        console.print(f"  {pre['programs']} programs in {pre['seconds']:.1f} s; device memory used "
                      f"by compiling: {results['prewarm_device_bytes']} bytes")
        trainer.run(3)  # warm
        plain_round(2)
        # Side by side: rounds of each step in turn, so that a drift of the machine (clocks,
        # temperature, the other processes) falls on both alike; the median round of each.
        console.print(f"timing both steps: {ROUNDS} rounds of {args.steps} steps each, in turn ...")
        copies_before = pimhbm._core.unaliased_copies_by_op()
        rounds = {"plain": lambda: plain_round(args.steps),
                  "protected": lambda: trainer.run(trainer.next_step + args.steps - 1)}
        times: dict[str, list[float]] = {"plain": [], "protected": []}
        for rep in range(ROUNDS):  # ABBA: each step goes first in every other round
            for kind in (("plain", "protected") if rep % 2 == 0 else ("protected", "plain")):
                times[kind].append(_timed_round(rounds[kind]) / args.steps)
        plain_times, protected_times = times["plain"], times["protected"]
        plain, protected = statistics.median(plain_times), statistics.median(protected_times)
        results["plain_ms"] = plain * 1e3
        results["protected_ms"] = protected * 1e3
        results["rounds_ms"] = {"plain": [t * 1e3 for t in plain_times],
                                "protected": [t * 1e3 for t in protected_times]}
        results["overhead"] = protected / plain - 1
        # The same from each round's pair (a check on the medians' ratio above).
        results["overhead_of_paired_rounds"] = statistics.median(
            b / a - 1 for a, b in zip(plain_times, protected_times))
        # In-place results XLA did not alias (each a copy the timing above paid for).
        results["unaliased_by_op"] = _tally_since(copies_before,
                                                  pimhbm._core.unaliased_copies_by_op())
        results["unaliased_copies_per_step"] = sum(
            t["results"] for t in results["unaliased_by_op"].values()) / (ROUNDS * args.steps)
        if args.profile:
            profiles["plain"] = device_profile.trace(os.path.join(args.profile, "plain"),
                                                     lambda: plain_round(profile_steps))
        del carry  # the plain step's state: not needed any more
        if args.profile:
            start = trainer.next_step
            profiles["protected"] = device_profile.trace(
                os.path.join(args.profile, "protected"),
                lambda: trainer.run(start + profile_steps - 1))
        results["compiles_after_prewarm"] = trainer.compiles

        table = Table(title=f"step time, {args.tokens} tokens, {len(devices)} x {dev.device_kind}")
        for col in ("step", "ms", "vs plain"):
            table.add_column(col, justify="left" if col == "step" else "right")
        table.add_row("plain optax.adamw", f"{plain * 1e3:.2f}", "1.000x")
        table.add_row("protected (pimhbm)", f"{protected * 1e3:.2f}", f"{protected / plain:.3f}x")
        console.print(table)
        console.print(f"cost of protection: {results['overhead'] * 100:+.2f} % (target <= 2 %): " +
                      ("[green]met[/]" if results["overhead"] <= 0.02 else "[red]not met[/]") +
                      f" (median of the {ROUNDS} rounds' own ratios: "
                      f"{results['overhead_of_paired_rounds'] * 100:+.2f} %)")
        if results["unaliased_copies_per_step"]:
            console.print(f"  ({results['unaliased_copies_per_step']:.2f} in-place results a step "
                          "were not aliased by XLA and were copied first)")
            for op, t in results["unaliased_by_op"].items():
                console.print(f"    {op}: {t['results']} results, {t['bytes'] / 2**20:.1f} MiB"
                              + (f", {t['in_command_buffer']} recorded into a command buffer "
                                 "(repeated on each replay)" if t["in_command_buffer"] else ""))
        if profiles:
            _print_profile(console, profiles, results, profile_steps, args.profile)

        if not args.no_campaign:
            steps = args.campaign_steps
            trainer.snapshot_every, trainer.scrub_every = 10, 5
            console.print(f"fault campaign: {args.faults} faults of each kind over {steps} steps, "
                          "against the same run without faults ...")
            trainer.restart(fresh())
            t0 = time.perf_counter()
            ref_stats = trainer.run(steps)
            ref_state = trainer.current_state()
            trainer.restart(fresh())
            campaign = Campaign(trainer, {k: args.faults for k in KINDS}, last_step=steps, seed=1)
            stats = trainer.run(steps, campaign=campaign)
            state = trainer.current_state()
            identical = all(state[k].tobytes() == ref_state[k].tobytes() for k in state)
            found = campaign.check(stats)
            results["campaign"] = {"faults": found, "bit_identical": identical,
                                   "repairs": stats.repairs, "host_restores": stats.host_restores,
                                   "replica_repairs": stats.replica_repairs,
                                   "replica_rebuilds": stats.replica_rebuilds,
                                   "ipc_pulls": stats.ipc_pulls,
                                   "incidents": [(i.step, i.kind, i.action) for i in stats.incidents],
                                   "steps_skipped": stats.steps_skipped,
                                   "compiles_after_prewarm": trainer.compiles,
                                   "seconds": time.perf_counter() - t0,
                                   "reference_incidents": len(ref_stats.incidents)}
            t = Table(title=f"fault campaign at {'tiny' if args.tiny else '8B-layer'} scale")
            for col in ("kind", "injected", "detected", "repaired", "missed"):
                t.add_column(col, justify="left" if col == "kind" else "right")
            for kind, row in found.items():
                t.add_row(kind, *(str(row[c]) for c in ("injected", "detected", "repaired", "missed")))
            console.print(t)
            if note := unlocated_note(found):
                console.print(note)
            replicas = (f"from a replica {stats.replica_repairs}, whole devices rebuilt "
                        f"{stats.replica_rebuilds}, chunks pulled over CUDA IPC "
                        f"{stats.ipc_pulls}, " if len(trainer.devices) > trainer.shard else "")
            console.print(f"chunks repaired {stats.repairs}, {replicas}host restores "
                          f"{stats.host_restores}, compilations after prewarm {trainer.compiles}; "
                          "final state " + ("[green]bit-identical[/] to the run without faults"
                                            if identical else "[red]DIFFERENT[/]"))
    finally:
        HostBackup.unlink(name)
        HostBackup.unlink(f"{name}.p{jax.process_index()}")  # a process's own region
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = results.get("compiles_after_prewarm", 1) == 0 and (
        args.no_campaign or (results["campaign"]["bit_identical"] and
                             all(r["missed"] == 0 for r in results["campaign"]["faults"].values())))
    return 0 if ok else 1

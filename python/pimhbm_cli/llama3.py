"""``pimhbm llama3``: Llama-3-8B-dimension layers trained under protection on a GPU.

Measures the step time with full protection and the Trainer's defaults (one copy of the state
updated in place, its digests checked and rewritten by the update, parity over groups of chunks,
commit-or-skip on the device, host snapshots and scrubs, the fault summary read one step later)
against the fastest plain step (``optax.adamw``, cuDNN attention, no deterministic flags), and
the device memory of both, each in a process of its own; then runs a fault campaign at this
scale and checks that it ends bit-identical to the same run without faults.

Bit-identical replays need a repeatable step. ``--deterministic`` (exact mode) builds it from
pimhbm's own attention (``pimhbm.attention``: its sums in a fixed order) and an embedding
gradient summed in a fixed order, without XLA's global deterministic flag (every other op of
this step repeats bit for bit without it; ``bench/determinism_bisect.py``); ``--tiny`` too (head
dim 16). Exact mode is timed as a row of its own against the same fast plain step: its cost is
what bit-identity costs.

``--processes N`` runs the same job as N processes of one host, the way clusters run it: each
process drives its share of the devices (one GPU each on a GPU machine), they meet through
``jax.distributed`` on a localhost coordinator, and process 0 prints and writes the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any, Callable, NamedTuple

import numpy as np

from pimhbm_cli import llama3_memory
from pimhbm_cli import llama3_report as report
from pimhbm_cli import processes
from pimhbm_cli import options
from pimhbm_cli.options import non_negative_int, positive_int

ROUNDS = 5  # timed rounds of each step, alternating plain and protected
PROFILE_STEPS = 6  # steps traced of each kind (fewer when --steps is smaller)


def add_arguments(p) -> None:
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers of 8B dimensions")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step")
    p.add_argument("--seq", type=positive_int, default=4096, help="sequence length")
    p.add_argument("--vocab", type=positive_int, default=8192,
                   help="vocabulary (small: the layers, not the LM head, are measured)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed steps a round (5 rounds of each step in turn; default: the "
                        "snapshot interval, so that each protected round holds one host "
                        "snapshot, or 100 without snapshots: a round's start and end, the first "
                        "dispatch and the last summary's copy, then weigh little)")
    p.add_argument("--campaign-steps", type=positive_int, default=30, help="steps of the fault campaign")
    p.add_argument("--faults", type=non_negative_int, default=2, help="faults of each kind in the campaign")
    p.add_argument("--no-campaign", action="store_true", help="only the timings")
    p.add_argument("--deterministic", action="store_true",
                   help="exact mode: a repeatable step (pimhbm's attention, an ordered embedding "
                        "gradient), needed for bit-identical replays on GPUs")
    p.add_argument("--devices", type=positive_int, default=1,
                   help="data parallel over this many GPUs; both steps sharded alike")
    p.add_argument("--shard", type=positive_int, default=1,
                   help="FSDP: each replica's parameters split over this many devices")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny configuration of the same code instead of 8B dimensions (a "
                        "check of the tool on a CPU)")
    p.add_argument("--replica-transport", choices=("collective", "peer", "ipc"), default="collective",
                   help="how a chunk is pulled from a healthy replica (several devices): an XLA "
                        "collective, our kernel reading a peer GPU of this process (peer), or "
                        "of another process over CUDA IPC (ipc, with --processes)")
    p.add_argument("--state", choices=("one-copy", "two-slots"), default="one-copy",
                   help="one copy of the state updated in place, kept redundant by parity; or "
                        "two slots (the step writes the other) and a device copy")
    p.add_argument("--no-device-copy", action="store_true",
                   help="keep no redundancy of each device's own (no parity; with --state "
                        "two-slots no device copy): every damaged chunk is pulled from another "
                        "replica (needs more devices than --shard)")
    p.add_argument("--chunk-elems", type=positive_int, default=None,
                   help="elements a digest covers, the unit of repair (default: the state's -- "
                        "512 with one copy, whose update takes 128, 256 or 512; 4096 with two "
                        "slots)")
    options.add_checks(p)
    # The Trainer's SNAPSHOT_EVERY, written out: parsing loads no jax (tests/test_cli.py).
    p.add_argument("--snapshot-every", type=non_negative_int, default=250,
                   help="host snapshot every this many steps (the Trainer's default; 0: none)")
    p.add_argument("--scrub-every", type=non_negative_int, default=None,
                   help="a scrub between steps every this many steps (0: none; default: the "
                        "Trainer's -- none with one copy, whose steps check everything a scrub "
                        "would, every 10 with two slots)")
    p.add_argument("--processes", type=positive_int, default=1,
                   help="run as this many processes (jax.distributed on localhost), the devices "
                        "split evenly between them (1: one process sees them all)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also trace 6 steps of each kind with jax.profiler into DIR and print "
                        "where the device time goes (kernels by kind, the largest ones)")
    p.add_argument("--in-flight", type=positive_int, default=2,
                   help="the protected loop's steps in flight (the Trainer's in_flight)")
    p.add_argument("--no-telemetry", action="store_true",
                   help="no NVML watch beside the protected loop (the Trainer's telemetry=None)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after prewarm: Python's collector then leaves every object "
                        "made so far alone (a long collection stalls the host loop)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the device memory of both steps (each measured first in a process "
                        "of its own; never with --tiny or --processes)")
    p.add_argument("--memory-of", choices=llama3_memory.KINDS, default=None,
                   help=argparse.SUPPRESS)  # a child of the memory measurement
    p.add_argument("--no-exact-row", action="store_true",
                   help="skip the protected step in exact mode (timed first in a process of its "
                        "own, against this run's plain step; never with --tiny, --processes or "
                        "--deterministic)")
    p.add_argument("--exact-of-protected", action="store_true",
                   help=argparse.SUPPRESS)  # the child that times exact mode
    # Set by the launcher for each process of a --processes run.
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)


def _problem(args: Any) -> str | None:
    """What is wrong with the options, before anything starts."""
    if args.processes < 1:
        return "--processes must be at least 1"
    if ((args.replica_transport == "ipc" and args.processes < 2) or
            (args.replica_transport == "peer" and args.processes > 1)):
        return (f"--replica-transport {args.replica_transport}: 'ipc' pulls across processes "
                "(--processes 2 or more), 'peer' within one process")
    if args.no_device_copy and args.devices <= args.shard:
        return (f"--no-device-copy repairs from other replicas: it needs more devices than "
                f"--shard ({args.devices} devices, --shard {args.shard})")
    if args.state == "one-copy" and args.chunk_elems is not None:
        from pimhbm.inplace_calls import layout  # loads jax; starts no device
        if args.chunk_elems not in (sizes := tuple(layout()["chunk_elems"])):
            return f"--chunk-elems {args.chunk_elems}: the in-place update takes {sizes}"
    if problem := _checks_problem(args):
        return problem
    if args.state == "two-slots" and args.chunk_elems is not None:
        from pimhbm.update import check_chunk_elems  # loads jax; starts no device
        try:
            check_chunk_elems(args.chunk_elems)
        except ValueError as e:
            return f"--chunk-elems {args.chunk_elems} with --state two-slots: {e}"
    return None


def _checks_problem(args: Any) -> str | None:
    """What is wrong with --gradient-checks and --parameter-checks (--gradient-checks unset is
    the trainer's default: in the update where one copy has host snapshots)."""
    from pimhbm.train import StateKind, gradient_checks_for  # loads jax; starts no device
    before = options.CHECKS_WHERE[0]
    snapshots = args.snapshot_every > 0
    gradients = args.gradient_checks or options.checks_word(
        gradient_checks_for(StateKind(args.state), snapshots))
    if args.parameter_checks != before and gradients == before:
        if args.gradient_checks is None:  # the trainer's default fell back: say why
            needs = ("--state one-copy" if args.state == "two-slots"
                     else "host snapshots: --snapshot-every must be above 0")
            return (f"--parameter-checks {args.parameter_checks} checks the gradients in the "
                    f"update too, which needs {needs}")
        return (f"--parameter-checks {args.parameter_checks} takes no pass before the writes, "
                "so the gradients are checked in the update too: add --gradient-checks "
                f"{args.parameter_checks}")
    if gradients != before:
        if args.state == "two-slots":
            return (f"--gradient-checks {gradients} is for --state one-copy (two "
                    "slots check the gradients before the writes)")
        if not snapshots:
            return (f"--gradient-checks {gradients} needs host snapshots (a step "
                    "with a non-finite gradient is applied in part, then restored from one): "
                    "--snapshot-every must be above 0")
    return None


def run(args: Any) -> int:
    if problem := _problem(args):
        print(problem, file=sys.stderr)
        return 2
    if args.processes > 1 and args.process_id is None:
        return processes.launch(args)
    memory, exact_ms = None, None
    child = args.memory_of or args.exact_of_protected
    if not (args.no_memory or args.tiny or child or args.processes > 1):
        # Before this process touches the GPU: each child needs its memory to itself.
        memory = llama3_memory.measure_in_children(args.argv, options.console())
    if not (args.no_exact_row or args.tiny or child or args.processes > 1 or args.deterministic):
        exact_ms = llama3_memory.exact_in_child(args.argv, options.console())
    processes.join(args)  # one process of a --processes run: jax.distributed
    job = _setup(args)
    if isinstance(job, str):
        job_console(args).print(f"[red]{job}[/]")
        return 2
    if args.memory_of:
        llama3_memory.measure_here(job, args.memory_of)
        return 0
    if args.exact_of_protected:
        llama3_memory.exact_here(job)
        return 0
    if exact_ms is not None:
        job.results["exact_protected_ms"] = exact_ms
    if memory is not None:
        job.results["memory"] = memory
        llama3_memory.table(job.console, memory)
    return _measure(job)


def job_console(args: Any):
    import jax
    return options.console(quiet=jax.process_index() != 0)  # process 0 prints and writes the figures


def _attention(cfg: Any, platform: str, exact: bool) -> str:
    """cuDNN's fused attention on GPUs; in exact mode pimhbm's (repeatable without XLA's flag),
    or XLA's own where our kernels do not take the model's head dim (XLA's flag must then be
    on, and with it this XLA cannot run the cuDNN graph it compiled: openxla/xla#46500). CPUs:
    XLA's, repeatable as it is."""
    from pimhbm.attention import HEAD_DIMS
    from pimhbm.models import llama3

    if platform != "gpu":
        return "xla"
    if not exact:
        return "cudnn"
    supported = cfg.head_dim in HEAD_DIMS and cfg.dtype == "bfloat16"
    return llama3.PIMHBM_ATTENTION if supported else "xla"


class Job(NamedTuple):
    """What the measurements share: the devices, the model, the data."""

    args: Any
    console: Any
    devices: list
    dev: Any  # this process's first device (memory figures)
    mesh: Any  # ('dp', 'shard')
    cfg: Any  # llama3.Config
    batch: int  # sequences a step
    attention: str  # "cudnn", "pimhbm" or "xla" (llama3.decoder_layer's attention_impl)
    exact: bool  # exact-replay mode: the embedding's gradient summed in a fixed order too
    data: bytes
    results: dict  # the figures, written to --json

    def put(self, x: Any, sharding: Any):
        """A host value onto a (possibly several-process) sharding: each process fills its own
        devices' parts of the same value."""
        import jax
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def sharding(self, spec: Any):
        import jax
        return jax.sharding.NamedSharding(self.mesh, spec)


def _setup(args: Any) -> Job | str:
    """The devices as a mesh, the model's configuration, the figures' header; or what is wrong."""
    import jax

    from pimhbm.models import llama3
    from pimhbm.recovery.placement import xla_deterministic_flag

    if args.steps is None:  # a round of the snapshot interval holds exactly one snapshot
        args.steps = args.snapshot_every or 100
    if args.devices < 1 or args.devices > len(jax.devices()):
        return f"--devices {args.devices}: this machine has {len(jax.devices())}"
    if args.shard < 1 or args.devices % args.shard:
        return f"--shard {args.shard} must divide --devices {args.devices}"
    if args.tokens % args.seq or (args.tokens // args.seq) % args.devices:
        return ("--tokens must be a multiple of --seq, in sequences that split evenly over "
                "--devices")
    devices = jax.devices()[:args.devices]
    dev = jax.local_devices()[0]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(-1, args.shard), ("dp", "shard"))
    cfg = (llama3.tiny(layers=args.layers, vocab=args.vocab) if args.tiny else
           llama3.llama3_8b(layers=args.layers, vocab=args.vocab))
    # XLA's flag set by the user asks for exact mode too (and rules cuDNN's attention out: under
    # it this XLA cannot run the cuDNN graph it compiled).
    exact = args.deterministic or args.exact_of_protected or xla_deterministic_flag()
    attention = _attention(cfg, dev.platform, exact)
    batch = args.tokens // args.seq
    console = job_console(args)
    console.print(f"[bold]pimhbm llama3[/]: {args.layers} {'tiny' if args.tiny else 'Llama-3-8B'} "
                  f"layers (hidden {cfg.hidden}, intermediate {cfg.intermediate}, GQA "
                  f"{cfg.heads}/{cfg.kv_heads}, head {cfg.head_dim}), vocab {args.vocab}, "
                  f"{cfg.num_params() / 1e6:.0f} M parameters (bf16, fp32 master and moments), "
                  f"{batch} x {args.seq} = {args.tokens} tokens a step, on {len(devices)} x "
                  f"{dev.device_kind} ({len(devices) // args.shard} replicas x {args.shard} "
                  f"shards; {jax.process_count()} process(es)); "
                  f"exact mode: {'on, attention ' + attention if exact else 'off'}")
    data = np.random.default_rng(0).integers(0, 256, size=4_000_000, dtype=np.uint8).tobytes()
    results = {"device": dev.device_kind, "devices": len(devices),
               "processes": jax.process_count(), "shard": args.shard, "tiny": args.tiny,
               "replica_transport": args.replica_transport, "layers": args.layers,
               "device_copy": not args.no_device_copy, "state": args.state,
               "snapshot_every": args.snapshot_every, "scrub_every": args.scrub_every,
               "in_flight": args.in_flight, "gc_freeze": args.gc_freeze,
               "telemetry": not args.no_telemetry,
               "tokens": args.tokens,
               "params": cfg.num_params()}
    return Job(args, console, devices, dev, mesh, cfg, batch, attention, exact, data,
               results)


def _fresh_params(job: Job) -> Any:
    import jax

    from pimhbm.models import llama3
    return llama3.init(jax.random.key(0), job.cfg)  # the same weights every time


class PlainStep:
    """What a user runs without us: optax.adamw on fp32 master weights, bf16 parameters cast
    from them, sharded as the protected step (FSDP leaves split on their first dimension)."""

    def __init__(self, job: Job):
        import jax
        import jax.numpy as jnp
        import optax

        from pimhbm.models import llama3
        from pimhbm.recovery import fsdp_spec
        from pimhbm.train import text_batches, warmup_cosine

        P, args = jax.sharding.PartitionSpec, job.args
        fsdp = lambda x: job.sharding(fsdp_spec(x.shape, args.shard))
        params = jax.tree.map(lambda p: job.put(p, fsdp(p)), _fresh_params(job))
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4, weight_decay=0.01)
        cfg, attention, ordered = job.cfg, job.attention, job.exact

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, b, lr):
            master, opt, params = state
            opt.hyperparams["learning_rate"] = lr
            loss, grads = jax.value_and_grad(
                lambda p: llama3.loss(p, b, cfg, attention, ordered))(params)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            updates, opt = tx.update(grads, opt, master)
            master = optax.apply_updates(master, updates)
            # The loss goes back as a user's step hands it back (to log): without it XLA drops
            # the forward pass's loss and its one-hot product (~0.3 ms at the 8B layer).
            return (master, opt, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)), loss

        batch_fn = text_batches(job.data, job.batch, args.seq, 0)
        lr_of = warmup_cosine(3e-4, 5, 1000)
        self.batches = [jax.tree.map(lambda x: job.put(x, job.sharding(P(("dp", "shard")))),
                                     batch_fn(s + 1)) for s in range(args.steps)]
        self.lrs = [job.put(np.float32(lr_of(s + 1)), job.sharding(P()))
                    for s in range(args.steps)]
        job.console.print("compiling the unprotected step (optax.adamw) ...")
        opt0 = jax.jit(tx.init)(master)  # moments follow the master weights' sharding
        self.step = step
        self.carry, self.loss = jax.block_until_ready(step((master, opt0, params),
                                                           self.batches[0], self.lrs[0]))
        # The plain step's state (14 bytes a parameter) stays on the devices beside the
        # protected one until both are timed (rounds in turn).

    def round(self, steps: int) -> None:
        import jax
        for b, lr in zip(self.batches[:steps], self.lrs[:steps]):
            self.advance(b, lr)
        jax.block_until_ready(self.carry)

    def advance(self, batch: Any, lr: Any) -> None:
        """One step (dispatched, not waited for)."""
        self.carry, self.loss = self.step(self.carry, batch, lr)

    def close(self) -> None:
        self.carry = self.loss = None  # its device memory, for the rest of the run


def _protected(job: Job, shm_name: str, *, hooks: bool) -> Any:
    """The recovery engine's step, with the campaign's fault hooks compiled in (``hooks``) or
    as a user's Trainer has it (the timed step)."""
    from pimhbm.recovery.trainer import RECHECK_EVERY
    from pimhbm.train import llama_trainer
    args = job.args
    # The step is repeatable in exact mode, flag or not: sampled re-execution on, as the
    # Trainer's default turns it on for steps it knows to be repeatable.
    recheck = RECHECK_EVERY if job.exact else None
    return llama_trainer(job.cfg, job.data, steps=1000, batch=job.batch, seq=args.seq,
                         peak_lr=3e-4, warmup=5, shm_name=shm_name,
                         chunk_elems=args.chunk_elems or (4096 if args.state == "two-slots"
                                                          else None),
                         snapshot_every=args.snapshot_every, scrub_every=args.scrub_every,
                         inject_gradients=hooks, devices=job.devices, attention_impl=job.attention,
                         ordered_embedding=job.exact,
                         params=_fresh_params(job), replica_transport=args.replica_transport,
                         shard=args.shard, device_copy=not args.no_device_copy, state=args.state,
                         in_flight=args.in_flight, recheck_every=recheck,
                         telemetry=None if args.no_telemetry else "auto",
                         gradient_checks=options.gradient_checks(args.gradient_checks),
                         parameter_checks=options.parameter_checks(args.parameter_checks))


def _prewarm(job: Job, trainer: Any) -> None:
    job.console.print("prewarm (every program, from shapes) ...")
    before = job.dev.memory_stats() or {}
    pre = trainer.prewarm()
    after = job.dev.memory_stats() or {}
    used = after.get("bytes_in_use", 0) - before.get("bytes_in_use", 0) if before else None
    job.results["prewarm_seconds"] = pre["seconds"]
    job.results["prewarm_device_bytes"] = used
    job.console.print(f"  {pre['programs']} programs in {pre['seconds']:.1f} s; device memory "
                      f"used by compiling: {used} bytes")


def _tally_since(before: dict, after: dict) -> dict:
    """What ``pimhbm._core.unaliased_copies_by_op()`` counted between two readings, by op."""
    out = {}
    for op, t in after.items():
        d = {k: v - before.get(op, {}).get(k, 0) for k, v in t.items()}
        if d["results"]:
            out[op] = d
    return out


def _timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes (it runs a round of steps and waits for them)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _what_was_on(trainer: Any) -> dict:
    """The protection the timed step ran with (the report's "what was on")."""
    from pimhbm.inplace import GradientChecks, ParameterChecks
    redundancy = ("parity groups" if trainer.one_copy and trainer.local_source else
                  "device copy" if trainer.local_source else "replicas only")
    return {"snapshot_every": trainer.snapshots.every if trainer.backup is not None else 0,
            "scrub_every": trainer.scrub_every, "recheck_every": trainer.recheck_every,
            "redundancy": redundancy, "chunk_elems": trainer.opt.chunk_elems,
            "gradient_checks": getattr(trainer.opt, "gradient_checks",
                                       GradientChecks.BEFORE_WRITES).value,
            "parameter_checks": getattr(trainer.opt, "parameter_checks",
                                        ParameterChecks.BEFORE_WRITES).value,
            "fault_hooks": False}


def _time_both(job: Job, plain: PlainStep, trainer: Any) -> None:
    """Side by side: rounds of each step in turn (ABBA: each goes first in every other round),
    so that a drift of the machine (clocks, temperature, the other processes) falls on both
    alike; the median round of each."""
    import pimhbm

    steps, results = job.args.steps, job.results
    job.console.print(f"timing both steps: {ROUNDS} rounds of {steps} steps each, in turn ...")
    copies_before = pimhbm._core.unaliased_copies_by_op()
    rounds = {"plain": lambda: plain.round(steps),
              "protected": lambda: trainer.run(trainer.next_step + steps - 1)}
    times: dict[str, list[float]] = {"plain": [], "protected": []}
    for rep in range(ROUNDS):
        for kind in (("plain", "protected") if rep % 2 == 0 else ("protected", "plain")):
            times[kind].append(_timed(rounds[kind]) / steps)
    a, b = statistics.median(times["plain"]), statistics.median(times["protected"])
    results["plain_ms"], results["protected_ms"] = a * 1e3, b * 1e3
    results["rounds_ms"] = {k: [t * 1e3 for t in v] for k, v in times.items()}
    results["overhead"] = b / a - 1
    # The same from each round's pair (a check on the medians' ratio above).
    results["overhead_of_paired_rounds"] = statistics.median(
        q / p - 1 for p, q in zip(times["plain"], times["protected"]))
    # In-place results XLA did not alias (each a copy the timing above paid for).
    results["unaliased_by_op"] = _tally_since(copies_before, pimhbm._core.unaliased_copies_by_op())
    results["unaliased_copies_per_step"] = sum(
        t["results"] for t in results["unaliased_by_op"].values()) / (ROUNDS * steps)


def _campaign(job: Job, trainer: Any) -> None:
    """The same run twice from the same weights, the second under a campaign of every kind of
    fault; the verdict from the two final states."""
    from pimhbm.campaign import KINDS, Campaign, unlocated_note

    args, steps = job.args, job.args.campaign_steps
    trainer.snapshot_every, trainer.scrub_every = 10, 5
    job.console.print(f"fault campaign: {args.faults} faults of each kind over {steps} steps, "
                      "against the same run without faults ...")
    trainer.restart(_fresh_params(job))
    t0 = time.perf_counter()
    ref_stats = trainer.run(steps)
    ref_state = trainer.current_state()
    trainer.restart(_fresh_params(job))
    campaign = Campaign(trainer, {k: args.faults for k in KINDS}, last_step=steps, seed=1)
    stats = trainer.run(steps, campaign=campaign)
    state = trainer.current_state()
    identical = all(state[k].tobytes() == ref_state[k].tobytes() for k in state)
    found = campaign.check(stats)
    job.results["campaign"] = {
        "faults": found, "bit_identical": identical, "repairs": stats.repairs,
        "host_restores": stats.host_restores, "replica_repairs": stats.replica_repairs,
        "replica_rebuilds": stats.replica_rebuilds, "ipc_pulls": stats.ipc_pulls,
        "incidents": [(i.step, str(i.kind), i.describe()) for i in stats.incidents],
        "steps_skipped": stats.steps_skipped, "compiles_after_prewarm": trainer.compiles,
        "seconds": time.perf_counter() - t0, "reference_incidents": len(ref_stats.incidents)}
    report.campaign(job.console, found, unlocated_note(found), stats, trainer,
                    "tiny" if args.tiny else "8B-layer", identical)


def _profiles(job: Job, plain: PlainStep, trainer: Any) -> dict[str, str]:
    """Traces of a few steps of each kind (the plain step's state is freed between them)."""
    from pimhbm_cli import device_profile

    steps = min(PROFILE_STEPS, len(plain.batches))
    traces = {}
    if job.args.profile:
        traces["plain"] = device_profile.trace(os.path.join(job.args.profile, "plain"),
                                               lambda: plain.round(steps))
    plain.close()
    if job.args.profile:
        start = trainer.next_step
        traces["protected"] = device_profile.trace(
            os.path.join(job.args.profile, "protected"), lambda: trainer.run(start + steps - 1))
    return traces


def _measure(job: Job) -> int:
    """The step times, the profile, the campaign; the figures to --json; the exit code."""
    import jax

    from pimhbm.backup import HostBackup

    args, results = job.args, job.results
    plain = PlainStep(job)
    name = f"pimhbm_llama3_{uuid.uuid4().hex[:8]}"
    trainer = _protected(job, name, hooks=False)
    try:
        _prewarm(job, trainer)
        results["protection"] = _what_was_on(trainer)
        if args.gc_freeze:
            import gc
            gc.collect()
            gc.freeze()
        trainer.run(3)  # warm
        plain.round(2)
        _time_both(job, plain, trainer)
        traces = _profiles(job, plain, trainer)
        results["compiles_after_prewarm"] = trainer.compiles
        report.timing(job.console, results, args.tokens, len(job.devices), job.dev.device_kind,
                      ROUNDS)
        if traces:
            report.profile(job.console, traces, results, min(PROFILE_STEPS, args.steps),
                           args.profile, jax.process_index())
        if not args.no_campaign:  # a Trainer of its own: the fault hooks compiled in
            trainer.close(unlink=True)
            del trainer
            trainer = _protected(job, name, hooks=True)
            _prewarm(job, trainer)
            _campaign(job, trainer)
    finally:
        HostBackup.unlink(name)
        HostBackup.unlink(f"{name}.p{jax.process_index()}")  # a process's own region
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = results.get("compiles_after_prewarm", 1) == 0 and (
        args.no_campaign or (results["campaign"]["bit_identical"] and
                             all(r["missed"] == 0 for r in results["campaign"]["faults"].values())))
    return 0 if ok else 1

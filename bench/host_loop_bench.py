"""Where the protected loop's wall time goes: the host or the device.

A step is host-bound when the host needs longer to make and dispatch it than the device needs
to run the one before: then the host never waits on a step's summary, and the device idles
between steps. This bench runs `pimhbm llama3`'s two steps in one process, rounds in turn, and
per protected round records how long the host was blocked reading summaries (the device ahead)
and how long it spent in each of the loop's parts (the device possibly idle). Variants of the
protected loop run in the same rounds: more steps in flight, Python's collector frozen, the
NVML watch off, no host snapshots (in rounds of as many steps as the interval, each of the
other protected rounds holds exactly one: the difference is what one costs), plain's batches put from
the host each step (as the Trainer's are). Last, a cProfile of one protected round: the host
functions that take the time.

usage: python bench/host_loop_bench.py [--tiny] [--steps N] [--rounds 3] [--snapshots-only]
                                       [--json out.json]
       (--steps: by default the snapshot interval, as `pimhbm llama3`'s)
       (the model options are `pimhbm llama3`'s)
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import gc
import io
import pstats
import statistics
import sys
import time
import uuid
from typing import Any, Callable

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402

from pimhbm_cli import llama3  # noqa: E402


class HostClock:
    """Seconds the host spent in named parts of the Trainer's loop (wrapped methods)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - t0
        setattr(obj, name, timed)


def instrument(trainer: Any) -> HostClock:
    """Times the loop's parts: fetching summaries (blocked on the device), dispatching a step,
    the batch from its source, the telemetry poll, snapshots."""
    clock = HostClock()
    clock.wrap(trainer.placement, "fetch", "fetch (waits on the device)")
    clock.wrap(trainer, "_dispatch", "dispatch the step")
    clock.wrap(trainer.batches, "batch", "batch from the source/log")
    clock.wrap(trainer.health, "poll", "telemetry poll")
    clock.wrap(trainer.snapshots, "save_async", "snapshot dispatch")
    clock.wrap(trainer.snapshots, "confirm", "snapshot confirm")
    return clock


class HostBatches:
    """The plain step fed as a user's loop feeds it: each step's batch put from host arrays."""

    def __init__(self, job: Any, plain: Any) -> None:
        import jax
        P = jax.sharding.PartitionSpec
        self.job, self.plain = job, plain
        self.host = [jax.tree.map(np.asarray, b) for b in plain.batches]
        self.sharding = job.sharding(P(("dp", "shard")))

    def round(self, steps: int) -> None:
        import jax
        p = self.plain
        for b, lr in zip(self.host[:steps], p.lrs[:steps]):
            batch = {k: jax.device_put(v, self.sharding) for k, v in b.items()}
            p.advance(batch, lr)
        jax.block_until_ready(p.carry)


def variants(trainer: Any) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (set up, undo) of each protected variant."""
    monitor = trainer.health.monitor

    def telemetry(on: bool) -> None:
        trainer.health.monitor = monitor if on else None

    def frozen(on: bool) -> None:
        if on:
            gc.collect()
            gc.freeze()
        else:
            gc.unfreeze()

    def flight(n: int) -> None:
        trainer.in_flight = n

    every = trainer.snapshot_every

    def snapshots(on: bool) -> None:
        trainer.snapshot_every = every if on else 0
    return {"protected": (lambda: None, lambda: None),
            "protected, 3 in flight": (lambda: flight(3), lambda: flight(2)),
            "protected, gc frozen": (lambda: frozen(True), lambda: frozen(False)),
            "protected, no telemetry poll": (lambda: telemetry(False), lambda: telemetry(True)),
            "protected, no host snapshots": (lambda: snapshots(False), lambda: snapshots(True))}


# --snapshots-only: what a host snapshot costs, and nothing else (two kinds: ~3 minutes a module
# at the 8B layers, where all seven take ~8).
SNAPSHOT_KINDS = ("protected", "protected, no host snapshots")


def run_rounds(job: Any, plain: Any, trainer: Any, steps: int, rounds: int,
               clock: HostClock, snapshots_only: bool = False) -> dict[str, Any]:
    fed = HostBatches(job, plain)
    kinds = {} if snapshots_only else {
        "plain (batches on the device)": lambda: plain.round(steps),
        "plain (batches from the host)": lambda: fed.round(steps)}
    for name, (on, off) in variants(trainer).items():
        if snapshots_only and name not in SNAPSHOT_KINDS:
            continue
        def protected(on=on, off=off):
            on()
            try:
                trainer.run(trainer.next_step + steps - 1)
            finally:
                off()
        kinds[name] = protected
    times: dict[str, list[float]] = {k: [] for k in kinds}
    parts: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(rounds):
        order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
        for name in order:
            clock.seconds.clear()
            t0 = time.perf_counter()
            kinds[name]()
            times[name].append((time.perf_counter() - t0) / steps)
            parts[name].append({k: v / steps for k, v in clock.seconds.items()})
        job.console.print(f"  round {rep + 1}/{rounds} done")
    out = {}
    for name in kinds:
        med = statistics.median(times[name])
        per = {k: statistics.median(p.get(k, 0.0) for p in parts[name])
               for k in set().union(*parts[name])}
        out[name] = {"ms": med * 1e3, "rounds_ms": [t * 1e3 for t in times[name]],
                     "host_ms": {k: v * 1e3 for k, v in sorted(per.items())}}
    return out


def profile_round(trainer: Any, steps: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    trainer.run(trainer.next_step + steps - 1)
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def device_gaps(path: str, top: int = 8) -> dict[str, Any]:
    """The device's idle time over a traced round (first kernel to last), split into idle
    inside a program's run (its module on the trace's "XLA Modules" line) and between runs,
    and the longest gaps with the kernels on either side."""
    from pimhbm_cli import device_profile as dp
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                      str(e.get("name", "?"))) for e in dp._kernel_events(path))
    if not kernels:
        return {}
    events, _, lines = dp._trace_events(path)
    modules_line = {k for k, n in lines.items() if n.lower() == "xla modules"}
    modules = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                      str(e.get("name", "?"))) for e in events
                     if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in modules_line)
    busy = dp._merged([(a, b) for a, b, _ in kernels])
    gaps = [(busy[i][0] - busy[i - 1][1], busy[i - 1][1], busy[i][0]) for i in range(1, len(busy))]
    inside = lambda t: any(a <= t < b for a, b, _ in modules)
    at = lambda t: next((n for a, b, n in kernels if a <= t <= b + 0.01), "?")
    idle_in = sum(g for g, a, _ in gaps if inside(a))
    longest = sorted(gaps, reverse=True)[:top]
    return {"window_us": kernels[-1][1] - kernels[0][0],
            "busy_us": sum(b - a for a, b in busy),
            "idle_inside_programs_us": idle_in,
            "idle_between_programs_us": sum(g for g, _, _ in gaps) - idle_in,
            "programs": collections.Counter(n for _, _, n in modules),
            "longest_gaps": [{"us": g, "after": at(a)[:60], "before": at(b)[:60],
                              "inside_a_program": inside(a)} for g, a, b in longest]}


def traced_rounds(job: Any, plain: Any, trainer: Any, steps: int, where: str) -> dict[str, Any]:
    """A traced round of each step: the device's gaps per step."""
    from pimhbm_cli import device_profile as dp
    import os
    out = {}
    start = trainer.next_step
    for name, fn in (("plain", lambda: plain.round(steps)),
                     ("protected", lambda: trainer.run(start + steps - 1))):
        path = dp.trace(os.path.join(where, name), fn)
        g = device_gaps(path)
        if g:
            dp.write_timeline(path, os.path.join(where, f"{name}_timeline.json.gz"))
            per = {k: g[k] / steps / 1e3 for k in ("window_us", "busy_us",
                                                  "idle_inside_programs_us",
                                                  "idle_between_programs_us")}
            job.console.print(f"{name}: ms a step over the traced round: " +
                              ", ".join(f"{k[:-3]} {v:.3f}" for k, v in per.items()))
            for gap in g["longest_gaps"]:
                job.console.print(f"    gap {gap['us']:.0f} us after {gap['after']!r} before "
                                  f"{gap['before']!r} (inside a program: "
                                  f"{gap['inside_a_program']})")
            job.console.print(f"    programs: {dict(g['programs'])}")
            out[name] = {**g, "per_step_ms": per}
    return out


def llama3_job(p: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The parsed options and `pimhbm llama3`'s job from them (None, said why, where they do
    not hold)."""
    args = p.parse_args()
    args.argv = sys.argv[1:]
    job = llama3._setup(args)
    if isinstance(job, str):
        print(job, file=sys.stderr)
        return args, None
    return args, job


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama3.add_arguments(p)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every kind, in turn")
    p.add_argument("--top", type=int, default=25, help="functions listed by the profile")
    p.add_argument("--snapshots-only", action="store_true",
                   help="only the protected loop with and without host snapshots, in turn: "
                        "what a snapshot costs a step, with one compiled step")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also trace a round of each step (jax.profiler) and print the device's "
                        "idle time inside and between programs, and the longest gaps")
    args, job = llama3_job(p)
    if job is None:
        return 2
    from pimhbm.backup import HostBackup
    from rich.table import Table

    plain = llama3.PlainStep(job)
    name = f"pimhbm_hostloop_{uuid.uuid4().hex[:8]}"
    trainer = llama3._protected(job, name, hooks=False)
    try:
        llama3._prewarm(job, trainer)
        trainer.run(3)
        plain.round(2)
        clock = instrument(trainer)
        results = run_rounds(job, plain, trainer, args.steps, args.rounds, clock,
                             args.snapshots_only)
        profile = "" if args.snapshots_only else profile_round(trainer, args.steps, args.top)
        gaps = {}
        if args.trace:
            try:
                gaps = traced_rounds(job, plain, trainer, args.steps, args.trace)
            except Exception:  # the timings above still count
                import traceback
                traceback.print_exc()
    finally:
        HostBackup.unlink(name)
    print(profile)
    against = SNAPSHOT_KINDS[1] if args.snapshots_only else "plain (batches from the host)"
    base = results[against]["ms"]
    table = Table(title=f"ms a step ({args.steps}-step rounds, medians of {args.rounds}); host "
                        "ms a step in the loop's parts")
    for col in ("kind", "ms", f"vs {against}", "host: waits on device", "host: dispatch",
                "host: other parts"):
        table.add_column(col)
    for kind, r in results.items():
        h = r["host_ms"]
        wait = h.get("fetch (waits on the device)", 0.0)
        others = {k: v for k, v in h.items() if k not in ("fetch (waits on the device)",
                                                          "dispatch the step")}
        table.add_row(kind, f"{r['ms']:.2f}", f"{r['ms'] / base:.4f}", f"{wait:.2f}",
                      f"{h.get('dispatch the step', 0.0):.2f}",
                      ", ".join(f"{k} {v:.2f}" for k, v in others.items()))
    job.console.print(table)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "profile": profile,
                               "gaps": gaps,
                               "params": job.cfg.num_params()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

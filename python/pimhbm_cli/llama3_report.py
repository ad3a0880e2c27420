"""What ``pimhbm llama3`` prints: the step times side by side, the in-place results XLA did not
alias, where the device time goes (with --profile), and the fault campaign."""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table

from pimhbm_cli import device_profile

TARGET = 0.01  # the cost of protection the step is held to


def timing(console, results: dict, tokens: int, devices: int, kind: str, rounds: int) -> None:
    plain, protected = results["plain_ms"], results["protected_ms"]
    table = Table(title=f"step time, {tokens} tokens, {devices} x {kind}")
    for col in ("step", "ms", "vs plain"):
        table.add_column(col, justify="left" if col == "step" else "right")
    table.add_row("plain optax.adamw", f"{plain:.2f}", "1.000x")
    table.add_row("protected (pimhbm)", f"{protected:.2f}", f"{protected / plain:.3f}x")
    if (exact := results.get("exact_protected_ms")) is not None:
        # Timed in a process of its own (the flag is the process's), not in the ABBA rounds.
        table.add_row("protected, exact mode (own process)", f"{exact:.2f}",
                      f"{exact / plain:.3f}x")
    console.print(table)
    if (on := results.get("protection")) is not None:
        scrubs = (f"scrub every {on['scrub_every']}" if on["scrub_every"] else
                  "no scrubs between steps")
        console.print(f"  protected with: host snapshot every "
                      f"{on['snapshot_every']} steps, {scrubs}, sampled "
                      f"re-execution every {on['recheck_every']} (0: off), redundancy: "
                      f"{on['redundancy']}, chunks of {on['chunk_elems']} elements, non-finite "
                      f"gradients found {on['gradient_checks']}, damaged parameters found "
                      f"{on.get('parameter_checks', 'before the writes')}; no fault "
                      "hooks (the campaign's Trainer has them)")
    console.print(f"cost of protection: {results['overhead'] * 100:+.2f} % (target <= "
                  f"{TARGET:.0%}): " +
                  ("[green]met[/]" if results["overhead"] <= TARGET else "[red]not met[/]") +
                  f" (median of the {rounds} rounds' own ratios: "
                  f"{results['overhead_of_paired_rounds'] * 100:+.2f} %)")
    if results["unaliased_copies_per_step"]:
        console.print(f"  ({results['unaliased_copies_per_step']:.2f} in-place results a step "
                      "were not aliased by XLA and were copied first)")
        for op, t in results["unaliased_by_op"].items():
            console.print(f"    {op}: {t['results']} results, {t['bytes'] / 2**20:.1f} MiB"
                          + (f", {t['in_command_buffer']} recorded into a command buffer "
                             "(repeated on each replay)" if t["in_command_buffer"] else ""))


def _by_kind_of_kernel(console, sums: dict) -> None:
    t = Table(title="device time per step (ms), from the profiler")
    for col in ("kernels", "plain", "protected", "difference"):
        t.add_column(col, justify="left" if col == "kernels" else "right")
    for cat in sorted(set(sums["plain"]) | set(sums["protected"]), key=lambda c: c == "total"):
        a, b = sums["plain"].get(cat, 0.0), sums["protected"].get(cat, 0.0)
        t.add_row(cat, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}")
    console.print(t)


def _wall_time(console, walls: dict) -> None:
    t = Table(title="a device's wall time per step (ms), from the profiler's timeline")
    for col in ("", "plain", "protected", "difference"):
        t.add_column(col, justify="left" if not col else "right")
    for key in ("span", "busy", "idle", "collectives", "collectives exposed"):
        a, b = walls["plain"][key], walls["protected"][key]
        t.add_row(key, f"{a:.2f}", f"{b:.2f}", f"{b - a:+.2f}")
    console.print(t)


def _largest(console, profiles: dict, traces: dict, results: dict, steps: int) -> None:
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


def profile(console, traces: dict, results: dict, steps: int, out_dir: str, rank: int) -> None:
    """Device time per step by kind of kernel, plain against protected; where each device's
    wall time goes (busy, idle, collectives not hidden under compute); and the largest kernels
    of both steps (matmuls left out: the same in both); each step's kernels in order into
    ``out_dir``/KIND_timeline.json.gz. ``traces``: kind -> trace path; ``rank``: this process
    (each traced its own devices: its own file; the lead's keeps the plain name)."""
    profiles = {k: device_profile.device_events(p) for k, p in traces.items()}
    sums = {k: device_profile.summary(ev, steps) for k, ev in profiles.items()}
    results["profile_ms_per_step"] = sums
    _by_kind_of_kernel(console, sums)
    if not profiles["protected"]:
        console.print("(the trace holds no device timeline: nothing to split)")
        return
    for kind, path in traces.items():
        out = os.path.join(out_dir, f"{kind}_timeline{f'.{rank}' if rank else ''}.json.gz")
        n = device_profile.write_timeline(path, out)
        console.print(f"{kind} step: {n} device kernels of {steps} steps -> {out}")
    walls = {k: device_profile.overlap(p, steps) for k, p in traces.items()}
    results["profile_wall_ms_per_step"] = walls
    _wall_time(console, walls)
    _largest(console, profiles, traces, results, steps)


def campaign(console, found: dict, note: str | None, stats: Any, trainer: Any, scale: str,
             identical: bool) -> None:
    t = Table(title=f"fault campaign at {scale} scale")
    for col in ("kind", "injected", "detected", "repaired", "missed"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in found.items():
        t.add_row(kind, *(str(row[c]) for c in ("injected", "detected", "repaired", "missed")))
    console.print(t)
    if note:
        console.print(note)
    replicas = (f"from a replica {stats.replica_repairs}, whole devices rebuilt "
                f"{stats.replica_rebuilds}, chunks pulled over CUDA IPC "
                f"{stats.ipc_pulls}, " if len(trainer.devices) > trainer.shard else "")
    console.print(f"chunks repaired {stats.repairs}, {replicas}host restores "
                  f"{stats.host_restores}, compilations after prewarm {trainer.compiles}; "
                  "final state " + ("[green]bit-identical[/] to the run without faults"
                                    if identical else "[red]DIFFERENT[/]"))

"""``pimhbm demo`` (``make demo``): train a small Llama-3 twice with the same seed -- once without
faults, once under a campaign of every kind of fault -- and show that the second run ends
bit-identical to the first, every fault found, located and repaired.

The model learns the project's own text (byte level). While it runs: a progress bar with the
step, the loss and the faults injected / detected / repaired. At the end: a table by kind of
fault, the steps skipped and replayed, compilations after prewarm, the cost of protection; a
JSON file of every metric and a PNG of both loss curves with the faults marked. The verdict is
computed from the two final states; a missed fault or a mismatch exits non-zero.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import uuid
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pimhbm import report
from pimhbm.backup import HostBackup
from pimhbm.campaign import KINDS, Campaign, unlocated_note
from pimhbm.inplace import GradientChecks
from pimhbm.models import llama3
from pimhbm.recovery.placement import xla_deterministic_flag
from pimhbm.recovery.trainer import RECHECK_EVERY
from pimhbm.train import llama_trainer, text_batches, warmup_cosine
from pimhbm_cli import options
from pimhbm_cli.data import corpus_bytes
from pimhbm_cli.options import add_device, non_negative_int, positive_int

# The demo's faults come every few steps, so its host restores (each a replay from the last
# snapshot) are many: snapshots more often than the Trainer's default (SNAPSHOT_EVERY).
DEMO_SNAPSHOT_EVERY = 100


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=300, help="training steps")
    p.add_argument("--faults", type=non_negative_int, default=12, help="faults of each kind")
    p.add_argument("--kinds", nargs="*", default=None, choices=list(KINDS), metavar="KIND",
                   help="fault kinds (default: all of " + " ".join(KINDS) + ")")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=positive_int, default=64, help="model width")
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--seq", type=positive_int, default=64, help="bytes per sequence")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--out", default="demo-out", help="folder for metrics.json and loss.png")
    add_device(p)

def _run(console, title, trainer, steps, campaign=None):
    """Runs with a live progress bar (a line every tenth of the run when the output is not a
    terminal, so that a log shows how far a long run got); returns (stats, seconds)."""
    columns = [TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn("step {task.completed:>4}/{task.total}"), TextColumn("loss {task.fields[loss]}"),
               TextColumn("{task.fields[faults]}"), TimeElapsedColumn()]
    every = max(1, steps // 10)
    t0 = time.perf_counter()
    with Progress(*columns, console=console, transient=False,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(title, total=steps, loss="-", faults="")

        def update(step, stats):
            faults = ""
            if campaign is not None and (step % 5 == 0 or step == steps):
                inj, det, rep = progress_counts(campaign, stats, step)
                faults = f"faults injected {inj:>3} detected {det:>3} repaired {rep:>3}"
            progress.update(task, completed=step, loss=f"{stats.losses[step]:.3f}",
                            **({"faults": faults} if faults else {}))
            if not console.is_terminal and (step % every == 0 or step == steps):
                console.print(f"  {title}: step {step:>4}/{steps}  loss {stats.losses[step]:.3f}  "
                              f"{faults}  {time.perf_counter() - t0:6.1f} s", highlight=False)

        stats = trainer.run(steps, campaign=campaign, progress=update)
        return stats, time.perf_counter() - t0


def progress_counts(campaign: Campaign, stats: Any, step: int) -> tuple[int, int, int]:
    """Faults injected up to ``step``, and of those, how many were detected and repaired: a
    fault of a later step (already met by a step in flight, or on a replay) is not counted
    before its step is, so the line never shows more found than injected."""
    campaign.check(stats)  # marks each planned fault
    due = [f for f in campaign.plan if f.step <= step]
    return len(due), sum(f.detected for f in due), sum(f.repaired for f in due)


def _attention(device, exact: bool) -> str | None:
    """The attention of the plain step (``exact`` False: the fastest, XLA's pick) and of the
    protected runs, which must repeat bit for bit: on GPUs pimhbm's, repeatable without XLA's
    flag; XLA's own where the flag is on (set for head dims our kernels do not take: with it
    this XLA fails to run the cuDNN attention it compiled, see `pimhbm llama3`). CPUs: XLA's,
    repeatable as it is."""
    if xla_deterministic_flag():
        return "xla"
    return llama3.PIMHBM_ATTENTION if exact and device.platform == "gpu" else None


def _plain_step_seconds(cfg, data, args, device) -> float:
    """Seconds per step of the same training without protection -- optax.adamw on fp32 master
    weights, bf16 parameters cast from them, the same batches and learning rates, no digests,
    no copy, no checks -- over the same number of steps."""
    params = jax.device_put(llama3.init(jax.random.key(args.seed), cfg), device)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3, weight_decay=0.01)
    lr_of = warmup_cosine(3e-3, 20, args.steps)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch, lr):
        master, opt, params = state
        opt.hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(
            lambda p: llama3.loss(p, batch, cfg, _attention(device, exact=False)))(params)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt = tx.update(grads, opt, master)
        master = optax.apply_updates(master, updates)
        return (master, opt, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)), loss

    batch_fn = text_batches(data, args.batch, args.seq, args.seed)
    state = (master, tx.init(master), params)
    # Compile outside the timing, both variants: the first step's state carries optax's weakly
    # typed initial learning rate, the steps after it a float32 one (a second program).
    warm_batch = jax.device_put(batch_fn(1), device)
    warm, _ = step(jax.tree.map(jnp.copy, state), warm_batch, np.float32(0))
    jax.block_until_ready(step(warm, warm_batch, np.float32(0)))
    t0 = time.perf_counter()
    for s in range(1, args.steps + 1):
        state, loss = step(state, jax.device_put(batch_fn(s), device), np.float32(lr_of(s)))
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / args.steps


class Runs(NamedTuple):
    """The two runs of the demo: without faults, and under the campaign."""

    clean: Any  # Trainer
    faulty: Any
    ref_stats: Any  # RunStats
    stats: Any
    ref_seconds: float
    campaign: Campaign
    ref_state: dict
    state: dict

    @property
    def compiles(self) -> int:
        return self.clean.compiles + self.faulty.compiles


class Verdict(NamedTuple):
    table: dict  # Campaign.check: by kind of fault
    differing: list[str]  # tensors whose final bytes differ between the runs
    missed: int
    unrepaired: int
    compiles: int

    @property
    def identical(self) -> bool:
        return not self.differing

    @property
    def ok(self) -> bool:
        return self.identical and not (self.missed or self.unrepaired or self.compiles)


def _prewarm(console, trainer, title: str) -> dict:
    """The trainer's prewarm with a bar of its programs (on a terminal; a line a quarter of the
    way in a log)."""
    with Progress(TextColumn(f"  {title}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[what]}"), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(title, total=None, what="")
        quarters = set()

        def tick(done, total, what):
            bar.update(task, completed=done, total=total, what=what)
            quarter = 4 * done // total
            if not console.is_terminal and quarter not in quarters and quarter:
                quarters.add(quarter)
                console.print(f"  {title}: {done}/{total} programs", highlight=False)

        return trainer.prewarm(progress=tick)


def _both_runs(console, cfg, data, args, device, kinds) -> Runs:
    """Run 1 without faults, run 2 the same under the campaign: the same compiled programs
    (fault hooks included), host snapshots in shared memory (removed at the end)."""
    names = [f"pimhbm_demo_{uuid.uuid4().hex[:10]}_{k}" for k in ("clean", "faulty")]
    # The step repeats bit for bit on every platform (see _attention), which the Trainer cannot
    # tell without XLA's flag: sampled re-execution is asked for.
    common = dict(steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed,
                  snapshot_every=DEMO_SNAPSHOT_EVERY, inject_gradients=True, devices=[device],
                  attention_impl=_attention(device, exact=True), recheck_every=RECHECK_EVERY)
    try:
        clean = llama_trainer(cfg, data, **common, shm_name=names[0])
        pre = _prewarm(console, clean, "prewarm")
        console.print(f"prewarm: {pre['programs']} programs compiled from shapes in "
                      f"{pre['seconds']:.1f} s")
        ref_stats, ref_seconds = _run(console, "without faults", clean, args.steps)
        ref_state = clean.current_state()
        faulty = llama_trainer(cfg, data, **common, shm_name=names[1])
        _prewarm(console, faulty, "prewarm (the same programs, from the cache)")
        campaign = Campaign(faulty, {k: args.faults for k in kinds}, last_step=args.steps,
                            seed=args.seed + 1)
        stats, _ = _run(console, "under faults", faulty, args.steps, campaign)
        return Runs(clean, faulty, ref_stats, stats, ref_seconds, campaign, ref_state,
                    faulty.current_state())
    finally:
        for n in names:
            HostBackup.unlink(n)


def _verdict(runs: Runs) -> Verdict:
    table = runs.campaign.check(runs.stats)
    a, b = runs.state, runs.ref_state
    differing = sorted(set(a) ^ set(b)) + [k for k in a if k in b and a[k].tobytes() != b[k].tobytes()]
    return Verdict(table, differing, sum(r["missed"] for r in table.values()),
                   # Found (or overwritten before any check read them) but not repaired.
                   sum(r["injected"] - r["missed"] - r["repaired"] for r in table.values()),
                   runs.compiles)


def _print_tables(console, runs: Runs, verdict: Verdict, plain: float, cfg, device, args) -> None:
    out = Table(title="Faults by kind")
    for col in ("kind", "injected", "detected", "repaired", "missed"):
        out.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in verdict.table.items():
        out.add_row(kind, str(row["injected"]), str(row["detected"]), str(row["repaired"]),
                    f"[red]{row['missed']}[/]" if row["missed"] else "0")
    console.print(out)
    if note := unlocated_note(verdict.table):
        console.print(note)
    stats, protected = runs.stats, runs.ref_seconds / args.steps
    facts = Table(show_header=False, title="The run under faults")
    facts.add_column(justify="left")
    facts.add_column(justify="right")
    rows = [("steps committed (replays included)", stats.steps_committed),
            ("steps skipped (then replayed)", stats.steps_skipped),
            ("steps replayed", stats.steps_replayed),
            ("chunks repaired on the device (" + ("parity and redo" if runs.faulty.one_copy
                                                   else "device copy") + ")", stats.repairs),
            (f"restores from the host snapshot ({_restored_for(runs.faulty)})",
             stats.host_restores),
            ("host snapshots taken", stats.snapshots), ("scrubs", stats.scrubs),
            ("compilations after prewarm (both runs)", runs.compiles),
            ("time per protected step, no faults", f"{protected * 1e3:.1f} ms"),
            ("time per unprotected step (optax.adamw)", f"{plain * 1e3:.1f} ms"),
            ("cost of protection on this device", f"{(protected / plain - 1) * 100:+.0f} %"),
            ("final loss, both runs", f"{runs.ref_stats.losses[args.steps]:.4f} / "
                                      f"{stats.losses[args.steps]:.4f}"),
            ("hardware telemetry (NVML)", stats.telemetry),
            ("GPU-reported events (both runs); suspect devices",
             f"{len(runs.ref_stats.telemetry_events) + len(stats.telemetry_events)}; "
             f"{sorted(runs.ref_stats.suspect_devices | stats.suspect_devices) or 'none'}")]
    for k, v in rows:
        facts.add_row(k, str(v))
    console.print(facts)
    _print_what_the_cost_means(console, cfg, device)


def _restored_for(trainer) -> str:
    """What sends a step of this trainer to the host snapshot."""
    applied_in_part = getattr(trainer.opt, "gradient_checks", None) is GradientChecks.IN_UPDATE
    return "double faults" + (", non-finite gradients" if applied_in_part else "")


def _print_what_the_cost_means(console, cfg, device) -> None:
    if device.platform == "cpu":
        console.print("[dim]On a CPU the guarded update runs the plain reference loops (digests "
                      "computed chunk by chunk); the cost of protection is measured on the GPU by "
                      "`pimhbm llama3` and bench/.[/]")
    elif cfg.num_params() < 1e8:
        console.print(f"[dim]A model of {cfg.num_params() / 1e6:.2f} M parameters: each step's "
                      "fixed work (kernel launches of the checks, the host's per-step bookkeeping) "
                      "outweighs its arithmetic, so the cost above says little about a real model; "
                      "`pimhbm llama3` measures it at Llama-3-8B-layer scale.[/]")


def _metrics(args, cfg, device, runs: Runs, verdict: Verdict, plain: float) -> dict:
    stats, ref = runs.stats, runs.ref_stats
    return {
        "model": dataclasses.asdict(cfg), "steps": args.steps, "batch": args.batch, "seq": args.seq,
        "seed": args.seed, "device": f"{device.platform} ({device.device_kind})",
        "faults": verdict.table, "steps_committed": stats.steps_committed,
        "steps_skipped": stats.steps_skipped, "steps_replayed": stats.steps_replayed,
        "repairs": stats.repairs, "host_restores": stats.host_restores,
        "snapshots": stats.snapshots, "scrubs": stats.scrubs,
        "compilations_after_prewarm": runs.compiles,
        "seconds_per_protected_step": runs.ref_seconds / args.steps,
        "seconds_per_plain_step": plain,
        "bit_identical": verdict.identical, "differing_tensors": verdict.differing,
        "run_without_faults": ref.to_dict(), "run_under_faults": stats.to_dict(),
        "faults_planned": [{"step": f.step, "kind": f.kind, "tensor": f"{f.path}/{f.tensor}",
                            "chunks": list(f.chunks), "detected": f.detected,
                            "repaired": f.repaired} for f in runs.campaign.plan],
    }


def _print_verdict(console, verdict: Verdict) -> None:
    if verdict.ok:
        injected = sum(r["injected"] for r in verdict.table.values())
        console.print(f"[bold green]verdict: bit-identical[/] -- all {injected} faults found in "
                      "their chunk and repaired; the run under faults ended with exactly the "
                      "state of the run without.")
        return
    why = []
    if not verdict.identical:
        why.append(f"the final states differ in {len(verdict.differing)} tensors "
                   f"({', '.join(verdict.differing[:3])})")
    if verdict.missed:
        why.append(f"{verdict.missed} faults were missed")
    if verdict.unrepaired:
        why.append(f"{verdict.unrepaired} faults were found but not repaired")
    if verdict.compiles:
        why.append(f"{verdict.compiles} compilations after prewarm")
    console.print("[bold red]verdict: FAILED[/] -- " + "; ".join(why))


def run(args: Any) -> int:
    console = options.console()
    if args.device:
        jax.config.update("jax_default_device", jax.devices(args.device)[0])
    device = jax.devices(args.device)[0] if args.device else jax.devices()[0]
    kinds = args.kinds or list(KINDS)  # the parser took only known kinds
    os.makedirs(args.out, exist_ok=True)
    try:
        cfg = llama3.tiny(layers=args.layers, hidden=args.hidden)
    except ValueError as err:  # a width whose heads the model cannot split
        print(f"pimhbm demo: --hidden {args.hidden}: {err}", file=sys.stderr)
        return 2
    data = corpus_bytes()
    console.print(f"[bold]pimhbm demo[/]: Llama-3 ({cfg.layers} layers, hidden {cfg.hidden}, "
                  f"{cfg.num_params() / 1e6:.2f} M parameters, bf16 with fp32 master weights) on "
                  f"{len(data) / 1e3:.0f} KB of text, {args.steps} steps of {args.batch}x{args.seq} "
                  f"bytes, on {device.platform.upper()} ({device.device_kind}); seed {args.seed}; "
                  "exact replays by " + ("XLA's deterministic ops" if xla_deterministic_flag() else
                                         f"{_attention(device, exact=True) or 'XLA'} attention"))
    console.print("timing the unprotected step (optax.adamw) ...")
    plain = _plain_step_seconds(cfg, data, args, device)
    runs = _both_runs(console, cfg, data, args, device, kinds)
    verdict = _verdict(runs)
    _print_tables(console, runs, verdict, plain, cfg, device, args)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(_metrics(args, cfg, device, runs, verdict, plain), f, indent=1)
    plot = os.path.join(args.out, "loss.png")
    report.plot(runs.stats, plot, reference=runs.ref_stats, campaign=runs.campaign,
                title="Llama-3 (tiny) under protection: the two runs end " +
                      ("bit-identical" if verdict.identical else "DIFFERENT"))
    console.print(f"metrics: {os.path.join(args.out, 'metrics.json')}; plot: {plot}")
    _print_verdict(console, verdict)
    return 0 if verdict.ok else 1

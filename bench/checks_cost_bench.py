"""What the checks before the update cost the 8B-layer step, in one process: the full pass before
the writes (pimhbm.adamw's default) against the gradients checked in the update
(pimhbm.inplace.GradientChecks.IN_UPDATE, llama_trainer's default with host snapshots: the pass
before the writes reads p alone) and the speculative checks (ParameterChecks.IN_UPDATE too: no
pass before the writes).

Four steps in turn, in rounds of one snapshot interval: plain (optax.adamw, batches put from
the host as the Trainer's are), protected with the checks before the first write (p's digests and
the gradients' finiteness, 4 bytes a bf16 parameter), the same with p's digests alone before
the writes (2 bytes: the trainer's default), and with no pass before them; each with the
Trainer's other defaults. The options'
price is not in these figures: a step whose gradients the update finds non-finite with a
finite loss, and (speculative) a step where it finds a damaged parameter chunk, are applied in
part and come back from the host snapshot (a replay of up to the snapshot interval) where the
full pass cancels one step. Every protected step runs in this process, so their products are
autotuned alike; `pimhbm llama3` runs one protected step a process.

usage: python bench/checks_cost_bench.py [--tiny] [--rounds 3] [--json out.json]
       (the model options are `pimhbm llama3`'s; --steps: by default the snapshot interval)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Any, Callable, NamedTuple

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402
from host_loop_bench import HostBatches, llama3_job  # noqa: E402

from pimhbm_cli import llama3  # noqa: E402

PLAIN = "plain (batches from the host)"


class Checks(NamedTuple):
    """A protected step to time: its row's label and where its checks run (the CLI's words)."""

    label: str
    gradient_checks: str
    parameter_checks: str


CHECKS = (Checks("protected, p and gradients checked before the writes", "before-writes",
                 "before-writes"),
          Checks("protected, gradients checked in the update (default)", "in-update",
                 "before-writes"),
          Checks("protected, speculative checks (in the update)", "in-update", "in-update"))


def protected(job: Any, name: str, checks: Checks) -> Any:
    """A Trainer of `pimhbm llama3`'s timed step with its checks where ``checks`` says."""
    job.args.gradient_checks = checks.gradient_checks
    job.args.parameter_checks = checks.parameter_checks
    trainer = llama3._protected(job, name, hooks=False)
    llama3._prewarm(job, trainer)
    return trainer


def rounds(job: Any, kinds: dict[str, Callable[[], None]], steps: int, n: int) -> dict:
    times: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for rep in range(n):
        order = names[rep % len(names):] + names[:rep % len(names)]  # each kind first in turn
        for name in order:
            t0 = time.perf_counter()
            kinds[name]()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
        job.console.print(f"  round {rep + 1}/{n}: " +
                          ", ".join(f"{k[:40]} {times[k][-1]:.2f} ms" for k in names))
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama3.add_arguments(p)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every step, in turn")
    args, job = llama3_job(p)
    if job is None:
        return 2
    from pimhbm.backup import HostBackup
    from rich.table import Table

    plain = llama3.PlainStep(job)
    fed = HostBatches(job, plain)
    names = [f"pimhbm_checks_{uuid.uuid4().hex[:8]}" for _ in CHECKS]
    try:
        trainers = [protected(job, n, c) for n, c in zip(names, CHECKS)]
        for t in trainers:
            t.run(3)
        plain.round(2)

        def run(t):
            return lambda: t.run(t.next_step + args.steps - 1)
        kinds = {PLAIN: lambda: fed.round(args.steps)}
        kinds.update({c.label: run(t) for c, t in zip(CHECKS, trainers)})
        times = rounds(job, kinds, args.steps, args.rounds)
    finally:
        for n in names:
            HostBackup.unlink(n)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[PLAIN]
    held = ("; each protected round holds one host snapshot"
            if args.steps == args.snapshot_every else "")
    table = Table(title=f"ms a step ({args.steps}-step rounds, medians of {args.rounds}{held})")
    for col in ("step", "ms", "vs plain", "rounds' own ratios to plain (median)"):
        table.add_column(col)
    own = {k: statistics.median(a / b for a, b in zip(v, times[PLAIN]))
           for k, v in times.items()}
    for k in kinds:
        table.add_row(k, f"{med[k]:.2f}", f"{med[k] / base - 1:+.2%}", f"{own[k] - 1:+.2%}")
    job.console.print(table)
    # Every protected step holds the default's layout: the same device memory (`pimhbm llama3`
    # measures it, each step in a process of its own; here all live in one process).
    job.console.print("device memory: the state's layout is the same in every protected step "
                      "(held and peak: `pimhbm llama3`, a process each)")
    if args.json:
        # (args' checks are the last step's: each step's own are under "checks")
        write_json(args.json, {"args": vars(args), "checks": [c._asdict() for c in CHECKS],
                               "rounds_ms": times, "median_ms": med,
                               "rounds_ratio_median": own, "params": job.cfg.num_params(),
                               "device": str(job.dev.device_kind)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

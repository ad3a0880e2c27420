"""What the checks before the update cost the 8B-layer step, in one process: the default against
the speculative checks (pimhbm.inplace.ParameterChecks.IN_UPDATE with GradientChecks.IN_UPDATE),
which run no pass before the update's writes.

Three steps in turn, in rounds of one snapshot interval: plain (optax.adamw, batches put from
the host as the Trainer's are), protected with the Trainer's defaults (the checks before the
first write: p's digests and the gradients' finiteness, 4 bytes a bf16 parameter), and the same
protected step with the checks in the update alone. The speculative step's price is not in
these figures: a step where its update finds a damaged parameter chunk does not commit and
comes back from the host snapshot (a replay of up to the snapshot interval) where the default
cancels one step. Both protected steps run in this process, so their products are autotuned
alike; `pimhbm llama3` runs one protected step a process.

usage: python bench/checks_cost_bench.py [--tiny] [--rounds 3] [--json out.json]
       (the model options are `pimhbm llama3`'s; --steps: by default the snapshot interval)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Any, Callable

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402
from host_loop_bench import HostBatches, llama3_job  # noqa: E402

from pimhbm_cli import llama3  # noqa: E402

PLAIN = "plain (batches from the host)"
SPECULATIVE = "protected, speculative checks (in the update)"


def protected(job: Any, name: str, checks: str) -> Any:
    """A Trainer of `pimhbm llama3`'s timed step with both checks where ``checks`` says."""
    job.args.gradient_checks = job.args.parameter_checks = checks
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
    names = [f"pimhbm_checks_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        default = protected(job, names[0], "before-writes")
        speculative = protected(job, names[1], "in-update")
        for t in (default, speculative):
            t.run(3)
        plain.round(2)

        def run(t):
            return lambda: t.run(t.next_step + args.steps - 1)
        kinds = {PLAIN: lambda: fed.round(args.steps),
                 "protected (the Trainer's defaults)": run(default),
                 SPECULATIVE: run(speculative)}
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
    # Both protected steps hold the default's layout: the same device memory (`pimhbm llama3`
    # measures it, each step in a process of its own; here both live in one process).
    job.console.print("device memory: the state's layout is the same in both protected steps "
                      "(held and peak: `pimhbm llama3`, a process each)")
    if args.json:
        write_json(args.json, {"args": vars(args), "rounds_ms": times, "median_ms": med,
                               "rounds_ratio_median": own, "params": job.cfg.num_params(),
                               "device": str(job.dev.device_kind)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

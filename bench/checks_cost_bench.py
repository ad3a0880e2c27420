"""What the checks before the update cost the 8B-layer step, in one process: the ceiling of a
speculative verdict ("An option not taken" in bench/NOTES.md).

Three steps in turn, in rounds of one snapshot interval: plain (optax.adamw, batches put from
the host as the Trainer's are), protected with the Trainer's defaults (the checks before the
first write: p's digests and the gradients' finiteness, 4 bytes a bf16 parameter), and the same
protected step with no checks before the update at all -- the update alone finds damaged chunks
and non-finite gradients. That last step is NOT a protection mode: a parameter damaged before
the backward pass read it would be committed with the gradients it made. It is what a verdict
taken speculatively (write in place, restore the host snapshot and replay where the update
found a damaged parameter or a non-finite gradient) would cost a step at best, so that the
decision on it can be taken on a figure. Both protected steps run in this process, so their
products are autotuned alike.

usage: python bench/checks_cost_bench.py [--tiny] [--rounds 4] [--json out.json]
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
from host_loop_bench import HostBatches  # noqa: E402

from pimhbm_cli import llama3  # noqa: E402

NO_CHECKS = "protected, no checks before the update (bench only)"


def skip_checks() -> None:
    """From here on, an optimizer whose gradients are checked in the update (this bench's second
    protected step alone) takes no checks before its writes: every chunk reported intact."""
    import jax.numpy as jnp
    from pimhbm.inplace import AdamW, GradientChecks
    from pimhbm.inplace_calls import Prechecks
    original = AdamW._prechecks

    def prechecks(self, leaves, tables, grads):
        if self.gradient_checks is not GradientChecks.IN_UPDATE:
            return original(self, leaves, tables, grads)
        # The update's map of chunks found before it: all zero (a memset a leaf).
        zeros = [jnp.zeros((-(-leaf["p"].size // self.chunk_elems),), jnp.int32)
                 for leaf in leaves]
        return Prechecks(zeros, zeros, jnp.zeros((2,), jnp.int32)), grads
    AdamW._prechecks = prechecks


def protected(job: Any, name: str, checks: str) -> Any:
    job.args.gradient_checks = checks
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
    p.add_argument("--rounds", type=int, default=4, help="rounds of every step, in turn")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    job = llama3._setup(args)
    if isinstance(job, str):
        print(job, file=sys.stderr)
        return 2
    from pimhbm.backup import HostBackup
    from rich.table import Table

    plain = llama3.PlainStep(job)
    fed = HostBatches(job, plain)
    names = [f"pimhbm_checks_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        default = protected(job, names[0], "before-writes")
        skip_checks()  # before the second step is compiled
        bare = protected(job, names[1], "in-update")
        for t in (default, bare):
            t.run(3)
        plain.round(2)

        def run(t):
            return lambda: t.run(t.next_step + args.steps - 1)
        kinds = {"plain (batches from the host)": lambda: fed.round(args.steps),
                 "protected (the Trainer's defaults)": run(default), NO_CHECKS: run(bare)}
        times = rounds(job, kinds, args.steps, args.rounds)
    finally:
        for n in names:
            HostBackup.unlink(n)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain (batches from the host)"]
    table = Table(title=f"ms a step ({args.steps}-step rounds, medians of {args.rounds}; "
                        "each protected round holds one host snapshot)")
    for col in ("step", "ms", "vs plain", "rounds' own ratios to plain (median)"):
        table.add_column(col)
    own = {k: statistics.median(a / b for a, b in zip(v, times["plain (batches from the host)"]))
           for k, v in times.items()}
    for k in kinds:
        table.add_row(k, f"{med[k]:.2f}", f"{med[k] / base - 1:+.2%}", f"{own[k] - 1:+.2%}")
    job.console.print(table)
    if args.json:
        write_json(args.json, {"args": vars(args), "rounds_ms": times, "median_ms": med,
                               "rounds_ratio_median": own, "params": job.cfg.num_params(),
                               "device": str(job.dev.device_kind)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

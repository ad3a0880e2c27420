"""What the checks for finite wrong values cost, at Llama-3-8B-layer scale, side by side in one
run: plain optax.adamw, the protected step without sampled re-execution, and the protected step
with every step re-executed (recheck_every=1). A sampled step's extra time, divided by the
default interval (RECHECK_EVERY steps), is the re-execution's cost per step.

Sampled re-execution compares gradients bit for bit, so it runs in exact mode: XLA's
deterministic ops on (set here), and XLA's attention for all three steps (cuDNN's fused
attention fails to compile under that flag; see pimhbm_cli/llama3.py). The protected steps run
without snapshots and scrubs (as `pimhbm llama3` times them): the difference between them is the
re-execution alone. With several devices, the protected steps also compare the replicas' digest
tables every step (replica agreement): its cost is inside both protected figures, and
`pimhbm llama3 --devices N` measures it against plain optax.

usage: python bench/checks_bench.py [--layers 2] [--tokens 16384] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_deterministic_ops=true").strip()

import jax  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402

from pimhbm.recovery.trainer import RECHECK_EVERY  # noqa: E402
from pimhbm.train import llama_trainer  # noqa: E402
from pimhbm_cli import llama3  # noqa: E402

ROUNDS = 5
INTERVAL = RECHECK_EVERY  # the Trainer's default


def protected(job, recheck_every):
    args = job.args
    return llama_trainer(job.cfg, job.data, steps=1000, batch=job.batch, seq=args.seq,
                         peak_lr=3e-4, warmup=5, chunk_elems=4096, shm_name=None,
                         snapshot_every=0, scrub_every=0, devices=job.devices,
                         attention_impl=job.attention, params=llama3._fresh_params(job),
                         recheck_every=recheck_every)


def state_bytes(tree) -> int:
    """Bytes of a state on the first device (what it holds between steps)."""
    dev = jax.local_devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)


def timed_rounds(rounds: dict, steps: int) -> dict[str, float]:
    """Median seconds per step of each kind, in turn (the order rotates every round)."""
    times = {k: [] for k in rounds}
    kinds = list(rounds)
    for rep in range(ROUNDS):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            t0 = time.perf_counter()
            rounds[kind]()
            times[kind].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    llama3.add_arguments(p)
    p.set_defaults(steps=100)  # its rounds as before (llama3's default follows the snapshots)
    args = p.parse_args()
    job = llama3._setup(args)
    if isinstance(job, str):
        print(job, file=sys.stderr)
        return 2
    console, n = job.console, job.cfg.num_params()
    plain = llama3.PlainStep(job)
    trainers = {}
    for every in (0, 1):
        console.print(f"protected step, recheck_every={every}: prewarm ...")
        tr = trainers[every] = protected(job, every)
        tr.prewarm()
        tr.run(2)
    plain.round(2)
    steps = args.steps
    rounds = {"plain optax.adamw": lambda: plain.round(steps)}
    for every, tr in trainers.items():
        rounds[f"protected, recheck_every={every}"] = (
            lambda tr=tr: tr.run(tr.next_step + steps - 1))
    console.print(f"timing: {ROUNDS} rounds of {steps} steps of each, in turn ...")
    ms = {k: v * 1e3 for k, v in timed_rounds(rounds, steps).items()}
    base, off, every_step = ms.values()
    extra = every_step - off
    held = {"plain optax.adamw": state_bytes(plain.carry)}
    held.update({f"protected, recheck_every={e}": state_bytes(tr.state)
                 for e, tr in trainers.items()})
    peak = (job.dev.memory_stats() or {}).get("peak_bytes_in_use", 0)
    incidents = sum(len(tr.stats.incidents) for tr in trainers.values())
    compiles = sum(tr.compiles for tr in trainers.values())

    table = Table(title=f"{args.layers} {'tiny' if args.tiny else 'Llama-3-8B'} layers "
                        f"({n / 1e6:.0f} M parameters), "
                        f"{args.tokens} tokens a step, {job.dev.device_kind}, deterministic ops")
    for col in ("step", "ms/step", "vs plain", "state held, B/param"):
        table.add_column(col, justify="right" if col != "step" else "left")
    for k, v in ms.items():
        table.add_row(k, f"{v:.2f}", f"{v / base:.3f}", f"{held[k] / n:.1f}")
    console.print(table)
    console.print(f"a re-executed step costs {extra:.2f} ms more ({extra / off:.1%} of the "
                  f"protected step); every {INTERVAL} steps that is {extra / INTERVAL / off:.2%} "
                  f"of the protected step, {extra / INTERVAL / base:.2%} of plain optax.adamw. "
                  f"Peak device memory of the process (all three states at once): "
                  f"{peak / 2**30:.1f} GiB; incidents {incidents}; compilations after prewarm "
                  f"{compiles}")
    if args.json:
        write_json(args.json, {
            "device": job.dev.device_kind, "params": n, "tokens": args.tokens,
            "layers": args.layers, "ms_per_step": ms, "state_bytes_per_param":
            {k: v / n for k, v in held.items()}, "peak_bytes": peak,
            "recheck_extra_ms": extra, "recheck_cost_at_default": extra / INTERVAL / off,
            "recheck_cost_vs_plain_at_default": extra / INTERVAL / base,
            "incidents": incidents, "compiles_after_prewarm": compiles})
    return 0 if incidents == 0 and compiles == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

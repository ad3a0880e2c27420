"""Device memory of ``pimhbm llama3``'s two steps, each measured in a process of its own (so that
neither sees the other's buffers or allocator pool): the state held between steps (every array
the loop carries from one step to the next), the allocator's bytes in use between steps, and its
peak. The command starts itself once per step kind with ``--memory-of KIND`` before it touches
the GPU; each child prints one line ``MEMORY {json}`` and exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

from rich.table import Table

KINDS = ("plain", "protected")
STEPS = 3  # steps run before reading the figures (the peak of a steady step)
PREFIX = "MEMORY "


def measure_in_children(argv: list[str], console) -> dict[str, dict] | None:
    """Each kind's figures from a child process (``argv``: this command's arguments); None
    where a child failed (its output is shown)."""
    out = {}
    for kind in KINDS:
        console.print(f"device memory of the {kind} step, in a process of its own ...")
        run = subprocess.run([sys.executable, "-m", "pimhbm_cli", *argv, "--memory-of", kind,
                              "--no-campaign"], capture_output=True, text=True,
                             env=dict(os.environ), timeout=900)
        line = next((l for l in run.stdout.splitlines() if l.startswith(PREFIX)), None)
        if run.returncode != 0 or line is None:
            console.print(f"[red]the {kind} step's memory could not be measured[/] "
                          f"(exit {run.returncode}):\n{(run.stdout + run.stderr)[-2000:]}")
            return None
        out[kind] = json.loads(line[len(PREFIX):])
    return out


def measure_here(job: Any, kind: str) -> dict:
    """This process's figures for one step kind (``--memory-of``), printed as the MEMORY line."""
    import jax

    from pimhbm.backup import HostBackup
    from pimhbm_cli import llama3

    if kind == "plain":
        plain = llama3.PlainStep(job)
        plain.round(STEPS)
        held, params = _nbytes(plain.carry), _elements(plain.carry[2])
    else:
        name = f"pimhbm_llama3_mem_{uuid.uuid4().hex[:8]}"
        trainer = llama3._protected(job, name, hooks=False)
        try:
            trainer.prewarm()
            trainer.run(STEPS)
            jax.block_until_ready(trainer.state)
            held, params = _nbytes(trainer.state), _elements(trainer.state.opt.params)
        finally:
            trainer.close(unlink=True)
            HostBackup.unlink(name)
    stats = job.dev.memory_stats() or {}
    figures = {"state_bytes": held, "in_use_bytes": stats.get("bytes_in_use"),
               "peak_bytes": stats.get("peak_bytes_in_use"), "params": params}
    print(PREFIX + json.dumps(figures), flush=True)
    return figures


def _first_shards(tree: Any) -> list:
    """This process's first device's share of every array of ``tree``."""
    import jax
    return [x.addressable_shards[0].data for x in jax.tree.leaves(tree)]


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in _first_shards(tree))


def _elements(params: Any) -> int:
    """Parameters on one device (its shards of the sharded ones)."""
    return sum(x.size for x in _first_shards(params))


def table(console, memory: dict[str, dict]) -> None:
    """Held and peak memory of both steps, in GB and bytes a parameter (one device's)."""
    t = Table(title="device memory, one device, each step in its own process")
    for col in ("step", "state held", "B/param", "in use between steps", "peak", "peak B/param"):
        t.add_column(col, justify="left" if col == "step" else "right")
    gb = lambda b: "n/a" if b is None else f"{b / 1e9:.2f} GB"
    per = lambda b, n: "n/a" if b is None else f"{b / n:.2f}"
    for kind in KINDS:
        m = memory[kind]
        t.add_row(kind, gb(m["state_bytes"]), per(m["state_bytes"], m["params"]),
                  gb(m["in_use_bytes"]), gb(m["peak_bytes"]), per(m["peak_bytes"], m["params"]))
    console.print(t)
    plain, prot = memory["plain"], memory["protected"]
    console.print(f"state held: {prot['state_bytes'] / plain['state_bytes']:.3f}x plain's (target "
                  "<= 1.00x)" + ("" if prot["peak_bytes"] is None or plain["peak_bytes"] is None
                                 else f"; peak {prot['peak_bytes'] / plain['peak_bytes']:.3f}x "
                                      "plain's (target <= 1.10x)"))


# -- exact mode's row ------------------------------------------------------------------------------

EXACT_PREFIX = "EXACT "


def exact_in_child(argv: list[str], console) -> float | None:
    """The protected step's time in exact mode (bit-identical replays: pimhbm's attention, an
    ordered embedding gradient, no XLA flag), from a process of its own (its programs and
    memory its own); None where it failed."""
    console.print("the protected step in exact mode, in a process of its own ...")
    run = subprocess.run([sys.executable, "-m", "pimhbm_cli", *argv, "--exact-of-protected",
                          "--no-campaign"], capture_output=True, text=True, timeout=900)
    line = next((l for l in run.stdout.splitlines() if l.startswith(EXACT_PREFIX)), None)
    if run.returncode != 0 or line is None:
        console.print(f"[red]exact mode could not be timed[/] (exit {run.returncode}):\n"
                      f"{(run.stdout + run.stderr)[-2000:]}")
        return None
    return float(json.loads(line[len(EXACT_PREFIX):])["protected_ms"])


def exact_here(job: Any, rounds: int = 3) -> float:
    """This process's protected step time (in exact mode, as exact_in_child asks): the median
    of ``rounds`` rounds of --steps steps, printed as the EXACT line."""
    import statistics
    import time

    from pimhbm.backup import HostBackup
    from pimhbm_cli import llama3

    name = f"pimhbm_llama3_exact_{uuid.uuid4().hex[:8]}"
    trainer = llama3._protected(job, name, hooks=False)
    try:
        trainer.prewarm()
        trainer.run(3)  # warm
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            trainer.run(trainer.next_step + job.args.steps - 1)
            times.append((time.perf_counter() - t0) / job.args.steps)
    finally:
        trainer.close(unlink=True)
        HostBackup.unlink(name)
    ms = statistics.median(times) * 1e3
    print(EXACT_PREFIX + json.dumps({"protected_ms": ms}), flush=True)
    return ms

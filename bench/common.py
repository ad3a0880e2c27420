"""Timing helpers shared by the benchmarks (GPU timings; every figure is a median)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import jax


def time_jax(fn: Callable[..., Any], *args: Any, iters: int = 20, reps: int = 7) -> float:
    """Median seconds per call of a jitted ``fn``: calls are queued back to back (JAX dispatch
    is asynchronous) and the device is waited for once per batch, so host overhead hides
    behind device time when a call takes more than a few tens of microseconds."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def time_torch(fn: Callable[[], Any], iters: int = 20, reps: int = 7) -> float:
    """Median seconds per call of a torch CUDA ``fn``, timed with CUDA events."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / 1e3 / iters)
    return statistics.median(samples)


def write_json(path: str | None, payload: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)


def time_replica_repair(fn: Callable[..., Any], state: list, lists: Any, srcs: Any, reps: int,
                        fetch: Callable[[Any], Any] = None) -> tuple[float, bool]:
    """Median seconds of a repair program ``fn(tensor, table, lists, srcs) -> (tensor, table,
    statuses)`` from the call to the statuses on the host (``fetch``: how they come there; after
    two warm-up calls), ``state`` = [tensor, table] replaced by each call's (donated) results;
    and whether every device but the source (the first) reports its chunks repaired or not
    listed, and some repaired."""
    import numpy as np

    import pimhbm

    fetch = fetch or np.asarray
    samples = []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        state[0], state[1], status = fn(state[0], state[1], lists, srcs)
        status = fetch(status)  # waits: the chunks verified on every device
        if r >= 2:
            samples.append(time.perf_counter() - t0)
    others = np.asarray(status)[1:]
    ok = bool(((others == pimhbm.REPAIRED) | (others == pimhbm.NOT_LISTED)).all() and
              (others == pimhbm.REPAIRED).any())
    return statistics.median(samples), ok

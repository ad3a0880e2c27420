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

"""Where a step's device time goes: a few steps traced with ``jax.profiler`` and the device
events of the trace summed per kernel (or per XLA op where the trace names it).

Used by ``pimhbm llama3 --profile DIR`` to split the cost of protection into its kernels.
"""
from __future__ import annotations

import bisect
import collections
import functools
import glob
import gzip
import json
import os
from typing import Callable


def trace(log_dir: str, fn: Callable[[], None]) -> str:
    """Runs ``fn`` under the profiler; returns the path of the Perfetto trace it wrote."""
    import jax
    os.makedirs(log_dir, exist_ok=True)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        fn()
    found = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not found:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {log_dir}")
    return found[-1]


@functools.lru_cache(maxsize=4)
def _trace_events(path: str) -> tuple[tuple[dict, ...], frozenset, dict]:
    """The trace's events, its device (GPU) timelines' pids, and each device line's name by
    (pid, tid) (read once per trace)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    device_pids = frozenset(e["pid"] for e in events
                            if e.get("ph") == "M" and e.get("name") == "process_name" and
                            "gpu" in str(e.get("args", {}).get("name", "")).lower())
    lines = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in device_pids}
    return tuple(events), device_pids, lines


@functools.lru_cache(maxsize=4)
def _kernel_events(path: str) -> tuple[dict, ...]:
    """The trace's kernel events on its device (GPU) timelines: each stream's "X" events."""
    events, device_pids, lines = _trace_events(path)
    # A device's timeline also holds derived lines ("XLA Ops", "XLA Modules") over the same
    # time: only its streams' kernels count (all of its lines where none is named a stream).
    streams = {key for key, name in lines.items() if "stream" in name.lower()}
    return tuple(e for e in events
                 if e.get("ph") == "X" and e.get("pid") in device_pids and
                 (not streams or (e["pid"], e.get("tid")) in streams))


def _step_windows(path: str) -> dict[int, list[tuple[float, float]]]:
    """Per device pid, the [start, end) of each run of the traced program, from the device's
    "XLA Modules" line: the modules at least half as long as its longest (the step; not the
    small programs around it). Empty for a device without that line."""
    events, _, lines = _trace_events(path)
    modules = {key for key, name in lines.items() if name.lower() == "xla modules"}
    runs: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in modules:
            a = float(e.get("ts", 0.0))
            runs[e["pid"]].append((a, a + float(e.get("dur", 0.0))))
    out = {}
    for pid, spans in runs.items():
        longest = max(b - a for a, b in spans)
        out[pid] = sorted((a, b) for a, b in spans if b - a >= longest / 2)
    return out


def device_events(path: str) -> list[tuple[str, str, float]]:
    """(kernel name, XLA op or "", microseconds) of every event on the trace's device (GPU)
    timelines. Empty when the trace holds no device timeline (a CPU run)."""
    return [(str(e.get("name", "?")), _op(e), float(e.get("dur", 0.0)))
            for e in _kernel_events(path)]


def write_timeline(path: str, out: str) -> int:
    """Every device kernel of the trace as compact rows (device -- the trace's process id of
    the device's timeline --, stream, kernel, XLA op, start us, us), sorted by device and start,
    into ``out`` (gzipped JSON): a step's schedule to read or compare offline without the
    profiler's whole trace. Returns the number of rows."""
    rows = sorted(([e["pid"], e.get("tid"), str(e.get("name", "?")), _op(e),
                    float(e.get("ts", 0.0)), float(e.get("dur", 0.0))]
                   for e in _kernel_events(path)), key=lambda r: (r[0], r[4]))
    with gzip.open(out, "wt") as f:
        json.dump(rows, f)
    return len(rows)


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The union of [start, end) intervals as disjoint intervals, in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    return sum(b - a for a, b in _merged(intervals))


def _op(e: dict) -> str:
    """The XLA op a kernel event ran for ("" where the trace does not say)."""
    return str((e.get("args", {}) or {}).get("hlo_op", ""))


def overlap(path: str, steps: int) -> dict[str, float]:
    """Where each device's wall time goes, in ms per step averaged over the devices: "span"
    (first kernel's start to last kernel's end, copies and memsets left out of those bounds:
    category() "copies / memsets"), "busy" (some kernel running),
    "idle" (span - busy), "collectives" (some collective running) and "collectives exposed" (a
    collective running and no other kernel). Kernel time that runs concurrently counts once
    here, unlike summary(). Copies and memsets do not stretch the span: a short trace begins
    with the host's transfers for its first step and ends with its results' copies back, and
    the waits around them are the trace's edges, not a step's cost."""
    per_device: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in _kernel_events(path):
        start = float(e.get("ts", 0.0))
        per_device[e["pid"]].append((start, start + float(e.get("dur", 0.0)),
                                     category(str(e.get("name", "")))))
    out = dict.fromkeys(("span", "busy", "idle", "collectives", "collectives exposed"), 0.0)
    for kinds in per_device.values():
        bounds = ([(a, b) for a, b, c in kinds if c != "copies / memsets"] or
                  [(a, b) for a, b, _ in kinds])
        lo, hi = min(a for a, _ in bounds), max(b for _, b in bounds)
        events = [(max(a, lo), min(b, hi), c == "collectives") for a, b, c in kinds
                  if b > lo and a < hi]
        if not events:
            continue
        span = hi - lo  # events are clipped to [lo, hi]; the bounds' own events reach both ends
        busy = _union([(a, b) for a, b, _ in events])
        compute = _union([(a, b) for a, b, coll in events if not coll])
        values = {"span": span, "busy": busy, "idle": span - busy,
                  "collectives": _union([(a, b) for a, b, coll in events if coll]),
                  "collectives exposed": busy - compute}
        for k, v in values.items():
            out[k] += v / steps / 1e3 / len(per_device)
    return out


def collectives(path: str, steps: int, n: int = 12) -> list[tuple[str, int, float, float, float]]:
    """Each collective XLA op of the trace: (op, launches per step, ms per step, ms per step
    exposed, mean start as a fraction of its step). Sorted by exposed time, the n largest:
    which of the step's collectives the schedule leaves uncovered, and where in the step they
    sit. Per device, averaged over the devices.
    - exposed: the part of the op's own time during which no other kernel (collectives aside;
      copies and memsets count as cover, as in overlap()) runs on its device; two collectives
      running together each count theirs, so the ops' sum can exceed overlap()'s figure.
    - its step: the run of the program (the "XLA Modules" line of the device) that holds the
      op's start; where the trace has no such line, the device's kernels' span cut into
      ``steps`` equal parts. Clamped to [0, 1].
    - launches per step: over every device of the trace, rounded down."""
    per_device: dict[int, list[dict]] = collections.defaultdict(list)
    for e in _kernel_events(path):
        per_device[e["pid"]].append(e)
    windows = _step_windows(path)
    time: dict[str, float] = collections.defaultdict(float)
    exposed: dict[str, float] = collections.defaultdict(float)
    where: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for pid, events in per_device.items():
        merged = _merged([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                          for e in events if category(str(e.get("name", ""))) != "collectives"])
        steps_of = windows.get(pid)
        if not steps_of:  # equal parts of the device's span
            lo = min(float(e["ts"]) for e in events)
            hi = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
            part = (hi - lo) / steps
            steps_of = [(lo + i * part, lo + (i + 1) * part) for i in range(steps)]
        starts = [a for a, _ in steps_of]
        for e in events:
            if category(str(e.get("name", ""))) != "collectives":
                continue
            a = float(e["ts"])
            b = a + float(e.get("dur", 0.0))
            op = _op(e) or str(e.get("name", "?"))[:40]
            covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if x < b and y > a)
            time[op] += b - a
            exposed[op] += (b - a) - covered
            w0, w1 = steps_of[max(0, bisect.bisect_right(starts, a) - 1)]
            where[op] += min(max((a - w0) / (w1 - w0), 0.0), 1.0) if w1 > w0 else 0.0
            count[op] += 1
    devices = max(len(per_device), 1)
    rows = sorted(time, key=lambda op: -exposed[op])[:n]
    return [(op, count[op] // (steps * devices), time[op] / steps / devices / 1e3,
             exposed[op] / steps / devices / 1e3, where[op] / count[op]) for op in rows]


CATEGORIES = (  # first match wins; names are CUDA kernel names, lower-cased
    ("pimhbm kernels", ("pimhbm",)),
    ("matmuls", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "sm90_", "sm80_")),
    ("copies / memsets", ("memcpy", "memset", "copy")),
    ("collectives", ("nccl", "all_reduce", "all-reduce", "allreduce")),
)


def category(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other XLA kernels"


def summary(events: list[tuple[str, str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step by category (and "total")."""
    out: dict[str, float] = collections.defaultdict(float)
    for name, _, us in events:
        out[category(name)] += us / steps / 1e3
        out["total"] += us / steps / 1e3
    return dict(out)


def top_kernels(events: list[tuple[str, str, float]], steps: int, n: int = 15,
                skip: tuple[str, ...] = ("matmuls",)) -> list[tuple[str, str, float, int]]:
    """The n kernels (name, XLA op, ms per step, launches per step) taking the most time,
    leaving out the categories in ``skip``."""
    time: dict[tuple[str, str], float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for name, op, us in events:
        if category(name) in skip:
            continue
        time[name, op] += us
        count[name, op] += 1
    rows = sorted(time.items(), key=lambda kv: -kv[1])[:n]
    return [(name[:70], op[:40], us / steps / 1e3, count[name, op] // steps)
            for (name, op), us in rows]

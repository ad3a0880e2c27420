"""The profiler summaries of `pimhbm llama3 --profile`, on a synthetic trace with known answers."""
import gzip
import json

import numpy as np
import pytest

from pimhbm_cli import device_profile


def write_trace(tmp_path, kernels):
    """kernels: (device, stream, name, start_us, dur_us). Two device timelines with a derived
    "XLA Ops" line that must not count, and a host timeline that must not either."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    for d in (0, 1):
        pid = 10 + d
        events += [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{d}"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "Stream #13"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "Stream #14"}},
                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 9, "args": {"name": "XLA Ops"}},
                   {"ph": "X", "pid": pid, "tid": 9, "name": "fusion", "ts": 0, "dur": 10_000}]
    events.append({"ph": "X", "pid": 1, "tid": 1, "name": "host work", "ts": 0, "dur": 99_000})
    for device, stream, name, start, dur in kernels:
        events.append({"ph": "X", "pid": 10 + device, "tid": stream, "name": name, "ts": start,
                       "dur": dur, "args": {"hlo_op": name + "_op"}})
    path = tmp_path / "t.perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(path)


def test_overlap_counts_concurrent_kernels_once_and_finds_exposed_collectives(tmp_path):
    # Device 0: compute 0-1000 us, an all-reduce 500-1500 us on another stream (500 exposed),
    # a gap 1500-2000, compute 2000-2500. Device 1: compute 0-3000, an all-reduce inside it.
    path = write_trace(tmp_path, [
        (0, 1, "fusion_1", 0, 1000), (0, 2, "ncclDevKernel_AllReduce_Sum_bf16", 500, 1000),
        (0, 1, "pimhbm::adamw_kernel", 2000, 500),
        (1, 1, "sm90_xmma_gemm", 0, 3000), (1, 2, "ncclDevKernel_AllReduce_Sum_bf16", 100, 200)])
    w = device_profile.overlap(path, steps=1)
    # Per device, averaged: span (2.5 + 3.0) / 2, busy (2.0 + 3.0) / 2, idle (0.5 + 0) / 2,
    # collectives (1.0 + 0.2) / 2, exposed (0.5 + 0) / 2 -- in ms.
    assert w == pytest.approx({"span": 2.75, "busy": 2.5, "idle": 0.25, "collectives": 0.6,
                               "collectives exposed": 0.25})
    assert device_profile.overlap(path, steps=2)["busy"] == pytest.approx(1.25)
    # The plain sums count every kernel's own time (concurrent ones twice), derived lines never.
    s = device_profile.summary(device_profile.device_events(path), steps=1)
    assert s["collectives"] == pytest.approx(1.2) and s["pimhbm kernels"] == pytest.approx(0.5)
    assert s["matmuls"] == pytest.approx(3.0) and s["total"] == pytest.approx(5.7)


def test_copies_at_the_edges_of_a_trace_do_not_count_as_a_step(tmp_path):
    """A short trace of a training loop starts with the host's copies for its first step and
    ends with its results' copies back; the waits around them are not the steps' time. A copy
    between kernels still counts as busy, the gaps around it as idle."""
    path = write_trace(tmp_path, [
        (0, 2, "MemcpyH2D", 0, 100), (0, 1, "fusion_1", 3000, 1000),
        (0, 2, "MemcpyD2D", 4500, 200), (0, 1, "fusion_2", 5000, 1000),
        (0, 2, "MemcpyD2H", 7000, 50),
        (1, 1, "fusion_1", 0, 1000)])
    w = device_profile.overlap(path, steps=1)
    # Device 0: span 3000-6000, busy 1000 + 200 + 1000, idle 800; device 1: 1000 busy.
    assert w["span"] == pytest.approx((3.0 + 1.0) / 2)
    assert w["busy"] == pytest.approx((2.2 + 1.0) / 2)
    assert w["idle"] == pytest.approx(0.8 / 2)
    # A trace of copies only still has a span (nothing else to measure it by).
    (tmp_path / "only").mkdir()  # another path: traces are read once per path
    only = write_trace(tmp_path / "only", [(0, 2, "MemcpyH2D", 0, 100), (1, 2, "MemcpyH2D", 0, 300)])
    assert device_profile.overlap(only, steps=1)["busy"] == pytest.approx(0.2)


def test_union_of_random_intervals_equals_a_fine_grid(tmp_path):
    rng = np.random.default_rng(11)
    for _ in range(100):
        starts = rng.integers(0, 500, int(rng.integers(1, 20)))
        ends = starts + rng.integers(0, 100, starts.size)
        grid = np.zeros(700, bool)
        for a, b in zip(starts, ends):
            grid[a:b] = True
        assert device_profile._union(list(zip(starts.tolist(), ends.tolist()))) == grid.sum()


def test_collectives_are_listed_by_their_exposed_time(tmp_path):
    # Device 0: compute 0-1000 and 2000-2500; all-reduce A 500-1500 (500 exposed), B 1600-1800
    # (all exposed). Device 1: compute 0-3000; A 100-300 and B 2600-2700 (both hidden).
    path = write_trace(tmp_path, [
        (0, 1, "fusion_1", 0, 1000), (0, 2, "ncclAllReduceA", 500, 1000),
        (0, 2, "ncclAllReduceB", 1600, 200), (0, 1, "fusion_2", 2000, 500),
        (1, 1, "sm90_xmma_gemm", 0, 3000), (1, 2, "ncclAllReduceA", 100, 200),
        (1, 2, "ncclAllReduceB", 2600, 100)])
    rows = device_profile.collectives(path, steps=1)
    assert [r[0] for r in rows] == ["ncclAllReduceA_op", "ncclAllReduceB_op"]
    (op_a, n_a, ms_a, exp_a, at_a), (op_b, n_b, ms_b, exp_b, at_b) = rows
    assert n_a == n_b == 1
    # Per device, averaged over the two: A (1.0 + 0.2) / 2 ms, 0.5 / 2 exposed; B (0.2 + 0.1)
    # / 2 ms, 0.2 / 2 exposed.
    assert (ms_a, exp_a) == pytest.approx((0.6, 0.25))
    assert (ms_b, exp_b) == pytest.approx((0.15, 0.1))
    # Starts as a fraction of each device's compute span: A (500 / 2500 + 100 / 3000) / 2.
    assert at_a == pytest.approx((0.2 + 100 / 3000) / 2)
    assert at_b == pytest.approx((1600 / 2500 + 2600 / 3000) / 2)


def test_the_timeline_holds_every_device_kernel_in_order(tmp_path):
    # Names, streams and starts in different orders: the rows follow the starts.
    kernels = [(1, 2, "ncclAllReduceB", 200, 100), (0, 1, "fusion_2", 2000, 500),
               (0, 1, "fusion_1", 0, 1000), (1, 1, "sm90_xmma_gemm", 1000, 3000),
               (0, 2, "a_first_by_name", 1500, 10), (0, 1, "fusion_3", 1200, 10)]
    path = write_trace(tmp_path, kernels)
    out = tmp_path / "timeline.json.gz"
    assert device_profile.write_timeline(path, str(out)) == 6  # not the derived or host lines
    with gzip.open(out, "rt") as f:
        rows = json.load(f)
    assert [(r[0] - 10, r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
        (d, s, n, n + "_op", t, u) for d, s, n, t, u in sorted(kernels, key=lambda k: (k[0], k[3]))]


def test_collectives_sit_in_their_own_step_and_copies_cover_them(tmp_path):
    """Two steps of 1000 us (the "XLA Modules" line says where each runs), with an all-gather
    at the very start of each step (before any compute), an all-reduce at its end (after the
    last compute) and a copy running under one all-reduce."""
    kernels = []
    for s in (0, 1):
        t = 1000 * s
        kernels += [(0, 2, "ncclAllGather", t, 50), (0, 1, "fusion_1", t + 100, 700),
                    (0, 2, "ncclAllReduce", t + 850, 100)]
    kernels.append((0, 1, "MemcpyD2D", 1850, 100))  # covers step 1's all-reduce entirely
    path = write_trace(tmp_path, kernels)
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] += [
        {"ph": "M", "name": "thread_name", "pid": 10, "tid": 8, "args": {"name": "XLA Modules"}},
        {"ph": "X", "pid": 10, "tid": 8, "name": "jit_step", "ts": 0, "dur": 1000},
        {"ph": "X", "pid": 10, "tid": 8, "name": "jit_small", "ts": 990, "dur": 5},  # not a step
        {"ph": "X", "pid": 10, "tid": 8, "name": "jit_step", "ts": 1000, "dur": 1000}]
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    rows = {r[0]: r[1:] for r in device_profile.collectives(path, steps=2)}
    # One device: per step, the all-gather 50 us, all exposed; the all-reduce 100 us, exposed
    # in step 0 only (the copy covers it in step 1).
    assert rows["ncclAllGather_op"] == pytest.approx((1, 0.05, 0.05, 0.0))
    assert rows["ncclAllReduce_op"] == pytest.approx((1, 0.1, 0.05, 0.85))
    assert list(rows) == ["ncclAllGather_op", "ncclAllReduce_op"]  # most exposed first


def test_collectives_without_a_module_line_use_equal_steps(tmp_path):
    # Two steps over 0-2000 us: all-reduces at 0 (start of step 0), 1900 (near the end of step
    # 1) and a last one ending exactly at the span's end.
    path = write_trace(tmp_path, [
        (0, 2, "ncclA", 0, 100), (0, 1, "fusion_1", 100, 1700),
        (0, 2, "ncclB", 1900, 50), (0, 2, "ncclC", 1950, 50)])
    rows = {r[0]: r[1:] for r in device_profile.collectives(path, steps=2)}
    assert rows["ncclA_op"][3] == pytest.approx(0.0)
    assert rows["ncclB_op"][3] == pytest.approx(0.9)
    assert rows["ncclC_op"][3] == pytest.approx(0.95)
    assert rows["ncclA_op"][:3] == pytest.approx((0, 0.05, 0.05))  # one launch in two steps

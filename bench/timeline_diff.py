"""Where two traced rounds differ, kernel by kernel: the timelines `host_loop_bench.py --trace`
writes (`plain_timeline.json.gz`, `protected_timeline.json.gz`: rows of (pid, tid, name, stream,
start us, duration us)), summed by kernel name per step, the second minus the first.

Names are grouped without XLA's numeric suffixes (`input_reduce_fusion_26` counts as
`input_reduce_fusion`) and without argument lists. The products and attention (cuBLAS's nvjet,
XLA's Triton GEMMs, cuDNN) are summed apart: their autotuned kernels differ from program to
program and from run to run by ~1 ms a step at the 8B layer (bench/NOTES.md), more than most
changes of ours, so our kernels are best read as the rest. Host-to-device and device-to-host
copies run on their own streams beside the kernels and are left out of the totals.

usage: python bench/timeline_diff.py FIRST.json.gz SECOND.json.gz [--steps 20] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys

PRODUCTS = ("nvjet", "gemm_fusion", "cudnn", "void cudnn", "sm90_xmma", "cutlass")


def kernel_name(raw: str) -> str:
    name = re.sub(r"\(anonymous namespace\)::", "", raw)
    name = re.sub(r"\(.*", "", name)
    return re.sub(r"_\d+$", "", name)[:70]


def sums(path: str, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """ms a step and launches a step, by kernel name."""
    with gzip.open(path) as f:
        rows = json.load(f)
    ms, launches = collections.Counter(), collections.Counter()
    for row in rows:
        name = kernel_name(str(row[2]))
        ms[name] += float(row[5]) / 1e3 / steps
        launches[name] += 1 / steps
    return ms, launches


def totals(ms: collections.Counter) -> tuple[float, float]:
    """(products and attention, everything else but the copies) in ms a step."""
    products = sum(v for k, v in ms.items() if k.startswith(PRODUCTS))
    rest = sum(v for k, v in ms.items() if not k.startswith(PRODUCTS + ("Memcpy",)))
    return products, rest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--steps", type=int, default=20, help="steps in each traced round")
    ap.add_argument("--top", type=int, default=25, help="kernels listed, largest difference first")
    args = ap.parse_args()
    (a, na), (b, nb) = sums(args.first, args.steps), sums(args.second, args.steps)
    names = sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))
    print(f"{'kernel':70s} {'first ms':>9s} {'(n)':>6s} {'second ms':>9s} {'(n)':>6s} {'diff':>8s}")
    for k in names[:args.top]:
        print(f"{k:70s} {a[k]:9.3f} {na[k]:6.1f} {b[k]:9.3f} {nb[k]:6.1f} {b[k] - a[k]:+8.3f}")
    (pa, ra), (pb, rb) = totals(a), totals(b)
    print(f"products and attention: {pa:.3f} -> {pb:.3f} ms a step ({pb - pa:+.3f})")
    print(f"everything else (no copies): {ra:.3f} -> {rb:.3f} ms a step ({rb - ra:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

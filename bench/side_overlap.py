"""How much of one kernel's time ran beside the others: for each timeline that
`precheck_order_bench.py --trace` (or `host_loop_bench.py --trace`) wrote, the named kernel's
time a step, the part of it that other kernels overlapped, and how long the other streams sat
idle while it ran (the cost of running it "beside" them when they wait for it anyway).

usage: python bench/side_overlap.py TIMELINE.json.gz... [--kernel precheck] [--steps 10]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys


def union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def rows_of(path: str) -> list[list]:
    """The timeline's rows (device, stream, kernel, op, start us, us), by start."""
    with gzip.open(path, "rt") as f:
        return sorted(json.load(f), key=lambda r: r[4])


def summary(rows: list[list], kernel: str, steps: int) -> dict[str, float]:
    """us a step: the kernel's time, what other kernels overlapped of it, and its time minus
    that (the others idle while it ran)."""
    mine = [(r[4], r[4] + r[5]) for r in rows if kernel in str(r[2])]
    others = [(r[4], r[4] + r[5]) for r in rows if kernel not in str(r[2])]
    overlapped = 0.0
    for a, b in mine:
        overlapped += union([(max(a, x), min(b, y)) for x, y in others if x < b and y > a])
    own = sum(b - a for a, b in mine)
    return {"launches": len(mine) / steps, "us": own / steps,
            "overlapped_us": overlapped / steps, "alone_us": (own - overlapped) / steps,
            "streams": len({r[1] for r in rows})}


def one_step(rows: list[list], kernel: str, steps: int) -> list[tuple[float, float, str]]:
    """For each launch of the kernel in the middle step of the round: its length, and when the
    next kernel of another stream began, in us after its start (the other stream waited for it
    where that is about its length). Memsets, which need no SM, are passed over."""
    mine = [r for r in rows if kernel in str(r[2])]
    per = len(mine) // steps
    out = []
    for r in mine[per * (steps // 2): per * (steps // 2 + 1)]:
        nxt = next((x for x in rows if x[1] != r[1] and x[4] >= r[4]
                    and not str(x[2]).startswith("Memset")), None)
        out.append((r[5], (nxt[4] - r[4]) if nxt else float("nan"), str(nxt[2])[:40] if nxt else ""))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timelines", nargs="+")
    ap.add_argument("--kernel", default="precheck", help="a part of the kernel's name")
    ap.add_argument("--steps", type=int, default=10, help="steps in each traced round")
    ap.add_argument("--each", action="store_true",
                    help="also each launch of the middle step: when another stream's next "
                         "kernel began")
    args = ap.parse_args(argv)
    for path in args.timelines:
        rows = rows_of(path)
        s = summary(rows, args.kernel, args.steps)
        print(f"{path}: {s['launches']:.0f} launches, {s['us']:.1f} us a step, "
              f"{s['overlapped_us']:.1f} of it beside other kernels, {s['alone_us']:.1f} alone "
              f"({s['streams']} streams)")
        if args.each and s["streams"] > 1:
            for us, after, name in one_step(rows, args.kernel, args.steps):
                print(f"    ran {us:6.1f} us; the other stream's next kernel began {after:6.1f} us "
                      f"after its start ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

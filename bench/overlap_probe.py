"""Can a bandwidth-bound pass run beside the backward pass's products? On one GPU (torch): N
weight-gradient products (16384 tokens, 4096 x 14336, bf16) on one stream, M reductions of 251 MB
each on another; per round the products alone (before and after), both started together, and
the reductions alone; what the pair saves against the sum, per round and as a median, with the
second stream at the lowest and at the highest priority.

usage: python bench/overlap_probe.py OUT_DIR   (writes OUT_DIR/overlap.json)"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

TOKENS, HIDDEN, FFN = 16384, 4096, 14336
PRODUCTS, REDUCTIONS, ROUNDS = 12, 8, 9


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main(out_dir: str) -> int:
    dev = torch.device("cuda")
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, FFN, device=dev, dtype=torch.bfloat16)
    bufs = [torch.randn(503_000_000 // 4, device=dev, dtype=torch.bfloat16) for _ in range(4)]

    def products(stream):
        with torch.cuda.stream(stream):
            for _ in range(PRODUCTS):
                torch.matmul(x.t(), dy)

    def reductions(stream):
        with torch.cuda.stream(stream):
            for i in range(REDUCTIONS):
                torch.amax(bufs[i % len(bufs)])

    main_stream, out = torch.cuda.current_stream(), {}
    for name, priority in (("low", 0), ("high", -1)):
        side = torch.cuda.Stream(priority=priority)
        for _ in range(2):
            timed(lambda: products(main_stream))
            timed(lambda: reductions(side))
        saved = []
        for _ in range(ROUNDS):  # interleaved: the clock drifts between rounds
            alone = timed(lambda: products(main_stream))
            both = timed(lambda: (products(main_stream), reductions(side)))
            extra = timed(lambda: reductions(side))
            alone = (alone + timed(lambda: products(main_stream))) / 2
            saved.append(alone + extra - both)
        a = statistics.median(timed(lambda: products(main_stream)) for _ in range(3))
        b = statistics.median(timed(lambda: reductions(side)) for _ in range(3))
        hidden = statistics.median(saved)
        out[name] = dict(products_ms=a, reductions_ms=b, hidden_ms_median=hidden,
                         hidden_each=saved, hidden_fraction=hidden / b)
        print(name, f"products {a:.2f} ms, reductions {b:.3f} ms, hidden {hidden:.3f} ms "
              f"({hidden / b:.0%}); per round {[round(r, 2) for r in saved]}", flush=True)
    with open(os.path.join(out_dir, "overlap.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))

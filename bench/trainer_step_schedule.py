"""The Trainer's one-copy step (pimhbm llama3's, without the campaign's hooks) compiled for the
GPU a target config describes, without that GPU: whether the checks beside the backward pass keep
their order there (pimhbm.check_order.late_reads) and where the compiled step puts them.

usage: JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
       python bench/trainer_step_schedule.py --target-config FILE [--one-pass] [--json OUT]
(jax's CUDA plugin installed; FILE as for bench/precheck_order_bench.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json  # noqa: E402
from precheck_order_bench import compile_only_device, schedule  # noqa: E402

from pimhbm import check_order, inplace  # noqa: E402
from pimhbm.models import llama3  # noqa: E402
from pimhbm.recovery.feed import BatchFeed  # noqa: E402
from pimhbm.recovery.layout import StateLayout  # noqa: E402
from pimhbm.recovery.one_copy import OneCopy  # noqa: E402
from pimhbm.recovery.placement import Placement, Transport  # noqa: E402
from pimhbm.recovery.programs import Compiler  # noqa: E402
from pimhbm.recovery.snapshots import sample_batch  # noqa: E402
from pimhbm.train import text_batches  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--one-pass", action="store_true", help="the default checks instead")
    ap.add_argument("--exact", action="store_true",
                    help="exact mode's step: pimhbm.attention and the ordered embedding")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    device = compile_only_device(args.target_config)
    cfg = llama3.llama3_8b(layers=args.layers, vocab=8192)
    opt = inplace.adamw(3e-4, weight_decay=0.01, master_weights=True)
    shapes = llama3.abstract_params(cfg)
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)  # untouched pages
    placement = Placement([device], 1)
    layout = StateLayout.of(zeros, opt, [False] * len(jax.tree.leaves(shapes)), 1)
    feed = BatchFeed(text_batches(bytes(range(256)) * 4096, 4, 4096, 0), None, 1, False)
    _, batch_specs, _ = sample_batch(feed(1), 1)
    # cuDNN's graphs need the device: XLA's attention stands in for them in fast mode.
    attention = llama3.PIMHBM_ATTENTION if args.exact else "xla"
    loss = lambda p, b: llama3.loss(p, b, cfg, attention, args.exact)
    traced = OneCopy(feed.loss(loss), opt, jax.tree.structure(shapes), layout, placement, 64,
                     False, False, Transport.COLLECTIVE)
    traced = dataclasses.replace(traced, checks_beside=not args.one_pass)
    init = jax.jit(placement.manual(opt.init, (traced.param_specs,), traced.state_specs().opt))
    compiler = Compiler(traced, init, shapes, batch_specs, 16, False)
    compiler._step(0)
    hlo = compiler.programs.step[0].as_text()
    late = check_order.late_reads(hlo)
    out = {"device": device.device_kind, "exact": args.exact,
           "checks_beside_asked": not args.one_pass,
           "checks_beside_kept": compiler.t.checks_beside,
           "reads_after_their_check": None if late is None else len(late), **schedule(hlo)}
    print(out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

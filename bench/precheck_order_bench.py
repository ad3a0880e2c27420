"""The in-place update's checks in one pass after the backward pass, or one a leaf, each
ordered after its parameter's last read (check_order.py): where the compiled step puts them,
whether any read of a parameter comes after its check, and (on a GPU) the step time of each in
one run, as a ratio to the one pass, rounds in turn. (A third variant, the checks on a stream of
their own beside XLA's, lost too and left with its ops: bench/NOTES.md, "The checks per leaf
timed".)

The step is a user's loop on Llama-3-8B-dimension layers: the loss's gradient and
pimhbm.adamw's update in one jitted program, cuDNN attention on GPUs (XLA's elsewhere, and when
compiling without the device).

usage: python bench/precheck_order_bench.py [--layers 2] [--rounds 5] [--steps 10] [--json OUT]
       python bench/precheck_order_bench.py --tiny             (any backend: a small model)
       python bench/precheck_order_bench.py --target-config FILE
           (no GPU needed: jax's CUDA plugin compiles for the GPU that FILE describes -- a
           GpuTargetConfigProto in text, as jax's get_topology_for_devices(...).target_config
           gives it on that GPU -- and the schedule is read; nothing runs)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json  # noqa: E402

import check_order  # noqa: E402
from pimhbm import inplace  # noqa: E402
from pimhbm.models import llama3  # noqa: E402


def compile_only_device(target_config: str):
    """A device of jax's CUDA plugin that compiles for the described GPU without one."""
    from jax.experimental import topologies

    from pimhbm import _core
    import pimhbm._ffi

    for name, capsule in _core.registrations()["CUDA"].items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    pimhbm._ffi.ensure_registered()  # the host's handlers too
    with open(target_config) as f:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=f.read())
    return topo.devices[0]


def plan_of(cfg, attention: str, params, batch) -> tuple[int | None, ...]:
    """check_order.plan_for the loss of ``batch``, traced from shapes (the batch an input)."""
    leaves, treedef = jax.tree.flatten(params)

    def grads(b, *ls):
        return jax.value_and_grad(lambda p: llama3.loss(p, b, cfg, attention))(
            jax.tree.unflatten(treedef, ls))

    closed = jax.make_jaxpr(grads)(batch, *leaves)
    first = len(jax.tree.leaves(batch))
    return tuple(check_order.checks_after(closed, len(leaves), first))


def build(cfg, attention: str, opt, state, batch):
    """The compiled step of ``opt`` (pimhbm.adamw, or check_order.Ordered)."""
    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: llama3.loss(p, batch, cfg, attention))(
            state.params)
        new, report = opt.update(grads, state)
        return new, report.committed, loss

    return jax.jit(step, donate_argnums=0).lower(state, batch).compile()


def schedule(hlo: str) -> dict:
    """Where the entry computation runs the checks: how many come before its last product."""
    bodies = check_order._bodies(hlo)
    start = hlo.index("\nENTRY ")
    lines = hlo[start:hlo.index("\n}\n", start)].splitlines()

    def calls(line: str, pattern: str) -> bool:
        return bool(re.search(pattern, line)) or any(
            re.search(pattern, bodies.get(c, "")) for c in re.findall(r"calls=(%[\w.\-]+)", line))

    checks = [k for k, l in enumerate(lines) if calls(l, f'"{check_order.CHECK}"')]
    products = [k for k, l in enumerate(lines) if re.search(r" (fusion|custom-call)\(", l)
                and calls(l, r" dot\(|__cublas|__cudnn")]
    last = max(products, default=-1)
    # A check's results are int32 per chunk of its leaves: their length weighs it.
    chunks = {k: sum(int(n) for n in re.findall(r"s32\[(\d+)\]", lines[k].split(" = ")[1]
                                                  .split(" custom-call(")[0].split(" fusion(")[0]))
              for k in checks}
    before = sum(chunks[k] for k in checks if k < last)
    return {"checks": len(checks), "checks_before_the_last_product": sum(k < last for k in checks),
            "share_of_chunks_checked_before_it": round(before / max(1, sum(chunks.values())), 3)}


def measure(compiled: dict, state, batch, rounds: int, steps: int) -> tuple[dict, object]:
    """Median ms a step of each variant over ``rounds`` rounds of ``steps`` steps, in turn,
    and the state they leave (the steps donate theirs)."""
    times = {name: [] for name in compiled}
    for _ in range(2):  # warm up
        for fn in compiled.values():
            state, committed, loss = fn(state, batch)
    jax.block_until_ready(state)
    for r in range(rounds):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                state, committed, loss = fn(state, batch)
            jax.block_until_ready((state, committed, loss))
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f} ms"
                                                      for k, v in times.items()), flush=True)
    return {name: statistics.median(v) for name, v in times.items()}, state


def trace_rounds(compiled: dict, state, batch, steps: int, where: str) -> None:
    """One traced round of ``steps`` steps of each variant, its kernels written as a timeline
    (pimhbm_cli.device_profile.write_timeline: rows of device, stream, kernel, op, start, us)."""
    from pimhbm_cli import device_profile as dp
    for name, fn in compiled.items():
        def run():
            nonlocal state
            for _ in range(steps):
                state, committed, loss = fn(state, batch)
            jax.block_until_ready((state, committed, loss))
        slug = re.sub(r"\W+", "_", name).strip("_")
        path = dp.trace(os.path.join(where, slug), run)
        rows = dp.write_timeline(path, os.path.join(where, f"{slug}_timeline.json.gz"))
        print(f"{name}: traced {steps} steps, {rows} kernels", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a small model (any backend)")
    ap.add_argument("--target-config", help="compile for this GPU without one; run nothing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--trace", metavar="DIR", help="also trace a round of each variant (GPU): "
                    "DIR/<variant>_timeline.json.gz, every kernel's stream, start and length")
    args = ap.parse_args(argv)

    device = compile_only_device(args.target_config) if args.target_config else jax.devices()[0]
    on_gpu = device.platform == "gpu" and not args.target_config
    cfg = (llama3.tiny(layers=args.layers) if args.tiny
           else llama3.llama3_8b(layers=args.layers, vocab=8192))
    seq = 16 if args.tiny else args.seq
    attention = "cudnn" if on_gpu else "xla"
    where = jax.sharding.SingleDeviceSharding(device)
    opt = inplace.adamw(3e-4)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                            llama3.abstract_params(cfg))
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch, seq + 1), jnp.int32, sharding=where)}
    after = plan_of(cfg, attention, abstract, batch)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                         jax.eval_shape(opt.init, abstract))
    variants = {"one pass": opt, "per leaf, ordered": check_order.Ordered.of(opt, after)}
    print(f"{cfg.num_params() / 1e6:.0f} M parameters on {device.device_kind}; "
          f"each leaf's check after gradient: {list(after)}", flush=True)
    compiled, out = {}, {"device": device.device_kind, "order": after, "variants": {}}
    for name, variant in variants.items():
        compiled[name] = build(cfg, attention, variant, state, batch)
        hlo = compiled[name].as_text()
        late = check_order.late_reads(hlo)
        mem = compiled[name].memory_analysis()
        out["variants"][name] = {**schedule(hlo), "reads_after_their_check":
                                 None if late is None else len(late),
                                 "temp_bytes": getattr(mem, "temp_size_in_bytes", None)}
        print(f"{name}: {out['variants'][name]}", flush=True)
    if on_gpu:
        params = llama3.init(jax.random.key(0), cfg)
        live = jax.jit(opt.init)(jax.device_put(params, where))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab, (args.batch, seq + 1), np.int32)
        batch = {"tokens": jax.device_put(tokens, where)}
        ms, live = measure(compiled, live, batch, args.rounds, args.steps)
        base = ms["one pass"]
        for name, v in ms.items():
            out["variants"][name]["ms_a_step"] = v
            print(f"{name}: {v:.3f} ms a step ({v / base:.4f}x the one-pass checks)")
        if args.trace:
            trace_rounds(compiled, live, batch, args.steps, args.trace)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

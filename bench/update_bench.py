"""The guarded update on the GPU, side by side in one run with optax.adamw and
optax.apply_if_finite(optax.adamw), for 268 M parameters:
  fp32 parameters (fp32 moments), and bf16 parameters with fp32 master weights and moments.

usage: python bench/update_bench.py [--params 268435456] [--leaves 8 | --model-layers N]
                                   [--json out.json] [--profile DIR]
                                   [--inplace-only [REPS] [--chunk-elems 256]
                                    [--gradient-checks in-update [--parameter-checks in-update]]]
Reported: ms per step in a steady loop (the slope between batches of 5 and 25 steps, median of
7; and, beside it, per step of a batch of 25, which also carries the first step's dispatch),
effective TB/s over optax.adamw's traffic (28 bytes per parameter in both cases: fp32 p, mu, nu
read and written + fp32 g read; or fp32 master, mu, nu read and written + bf16 g read + bf16 p
written -- the guarded update moves 26 there: its master weights are the bf16 p and a 16-bit
remainder), and ratios to optax.adamw.
With --profile, a few steps of optax.adamw and of the guarded update are also traced and every
kernel of a step is listed with its device time, beside the step's span and idle time: where
the guarded step's time goes besides its update kernel.
With --inplace-only, only bf16 parameters with master weights: optax.adamw and the in-place
update (checks + update + parity, the library's defaults) in turn, REPS times in one process --
the figure to compare two builds of the in-place kernel by, one process each, in turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import write_json  # noqa: E402
from scan_bench import read_ceiling  # noqa: E402

import pimhbm  # noqa: E402
from pimhbm.models import llama3  # noqa: E402
from pimhbm import inplace  # noqa: E402
from pimhbm_cli import device_profile, options  # noqa: E402

LR = 1e-4
BYTES_PER_PARAM = 28


def timed_loop(step, carry, args, short=5, long=25, reps=7):
    """Seconds per step of carry = step(carry, *args) (carry donated), two ways, medians over
    reps of a batch of `short` steps and one of `long` steps (each waited for):
      steady -- the slope (t_long - t_short) / (long - short): a step of a training loop whose
        host keeps ahead of the device, what a step costs in training;
      batch -- t_long / long, which also carries, once a batch, the host's dispatch of the
        first step and the final wait (a latency a training loop pays once, not every step;
        larger for a program of more buffers and calls).
    Returns (steady, batch, long, carry)."""
    def run(n):
        nonlocal carry
        t0 = time.perf_counter()
        for _ in range(n):
            carry = step(carry, *args)
        jax.block_until_ready(carry)
        return time.perf_counter() - t0

    run(3)
    slopes, batches = [], []
    for _ in range(reps):
        t_short, t_long = run(short), run(long)
        slopes.append((t_long - t_short) / (long - short))
        batches.append(t_long / long)
    return statistics.median(slopes), statistics.median(batches), long, carry


PROFILE_STEPS = 10


def profile_steps(step, carry, args, log_dir):
    """Traces PROFILE_STEPS steps; returns (kernel rows, timeline per step, carry)."""
    box = [carry]

    def run():
        for _ in range(PROFILE_STEPS):
            box[0] = step(box[0], *args)
        jax.block_until_ready(box[0])

    path = device_profile.trace(log_dir, run)
    rows = device_profile.top_kernels(device_profile.device_events(path), PROFILE_STEPS, n=40,
                                      skip=())
    return rows, device_profile.overlap(path, PROFILE_STEPS), box[0]


def make_tree(n_params, leaves, dtype, seed):
    per = n_params // leaves
    keys = jax.random.split(jax.random.key(seed), leaves)
    return {f"w{i}": jax.random.normal(k, (per,), jnp.float32).astype(dtype) * 0.02
            for i, k in enumerate(keys)}


def model_tree(layers, dtype, seed):
    """The 8B-dimension model's parameters (`pimhbm llama3`'s defaults: vocabulary 8192), its
    leaves of every size from the norms' 4096 up: the update as the training step runs it."""
    cfg = llama3.llama3_8b(layers=layers, vocab=8192)
    cfg = dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name)
    tree = llama3.init(jax.random.key(seed), cfg)
    return jax.tree.map(lambda x: x * 0.02 if x.ndim == 1 else x, tree)


def optax_step(tx, params, bf16):
    """`tx`'s step, jitted with its carry donated, and a fresh carry: on fp32 master weights
    with the bf16 parameters cast after (bf16), else on the parameters themselves."""
    master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)
    carry = (master, tx.init(master)) + ((params,) if bf16 else ())

    def step(carry, g):
        m, s = carry[0], carry[1]
        g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g) if bf16 else g
        u, s = tx.update(g32, s, m)
        m = optax.apply_updates(m, u)
        return (m, s, jax.tree.map(lambda x: x.astype(jnp.bfloat16), m)) if bf16 else (m, s)

    return jax.jit(step, donate_argnums=0), carry


def bench_case(kind, n_params, leaves, profile_dir=None, model_layers=0):
    bf16 = kind == "bf16+master"
    pdtype = jnp.bfloat16 if bf16 else jnp.float32
    tree = ((lambda seed: model_tree(model_layers, pdtype, seed)) if model_layers else
            (lambda seed: make_tree(n_params, leaves, pdtype, seed)))
    params = tree(0)
    grads = jax.tree.map(lambda p: (p * 0.5 + 0.01).astype(pdtype), tree(1))
    n = sum(p.size for p in jax.tree.leaves(params))
    out, profiles = {}, {}

    # optax.adamw (on fp32 master weights for the bf16 case, casting the parameters after).
    for name, tx in (("optax.adamw", optax.adamw(LR)),
                     ("optax.apply_if_finite(adamw)", optax.apply_if_finite(optax.adamw(LR), 10**9))):
        jitted, carry = optax_step(tx, params, bf16)
        steady, batch, long, carry = timed_loop(jitted, carry, (grads,))
        out[name] = (steady, batch, long)
        if profile_dir and name == "optax.adamw":
            rows, wall, carry = profile_steps(jitted, carry, (grads,), f"{profile_dir}/{kind}-optax")
            profiles[name] = {"kernels": rows, "timeline": wall}
        del carry

    def time_guarded(opt, what, profile=False):
        """One guarded step's time with `opt`; the state it leaves must verify (the next step
        commits). With `profile` (and --profile), its kernels are traced too."""
        upd = jax.jit(lambda s, g, lr: opt.update(g, s, lr)[0], donate_argnums=0)
        steady, batch, long, state = timed_loop(upd, opt.init(params), (grads, jnp.float32(LR)))
        if profile and profile_dir:
            rows, wall, state = profile_steps(upd, state, (grads, jnp.float32(LR)),
                                              f"{profile_dir}/{kind}-pimhbm")
            profiles[what] = {"kernels": rows, "timeline": wall}
        report = jax.jit(lambda s, g, lr: opt.update(g, s, lr)[1])(state, grads, jnp.float32(LR))
        if not bool(report.committed):
            raise RuntimeError(f"{what}: the state did not verify at the next step")
        return steady, batch, long

    # Two slots (pimhbm.update.adamw): digests checked and rewritten, NaN/Inf counted,
    # commit-or-skip on the device.
    opt = pimhbm.update.adamw(LR, master_weights=bf16)
    out["two slots (guarded)"] = time_guarded(opt, "two slots", profile=True)
    # The same with the device copy kept current (written in the same pass, verified chunks).
    out["two slots + device copy"] = time_guarded(
        pimhbm.update.adamw(LR, master_weights=bf16, device_copy=True), "device copy")
    # The in-place update on one copy of the state: its checks before any write (the parameters'
    # digests, the gradients' finiteness), the update, and the parity of every 16 chunks.
    out["pimhbm.inplace (checks + update + parity)"] = time_guarded(
        inplace.adamw(LR, master_weights=bf16), "pimhbm.inplace", profile=True)
    out["pimhbm.inplace, chunks of 256"] = time_guarded(
        inplace.adamw(LR, master_weights=bf16, chunk_elems=256), "pimhbm.inplace, 256")
    out["pimhbm.inplace, no parity"] = time_guarded(
        inplace.adamw(LR, master_weights=bf16, group=0), "pimhbm.inplace, no parity")
    upd = jax.jit(lambda s, g, lr: opt.update(g, s, lr)[0], donate_argnums=0)
    state = opt.init(params)
    # A step that must skip (NaN in the gradient): the predicated restore copies the state back.
    leaves, treedef = jax.tree.flatten(grads)
    bad = jax.tree.unflatten(treedef, [leaves[0].ravel().at[12345].set(jnp.nan).reshape(leaves[0].shape)]
                             + leaves[1:])
    steady, batch, long, state = timed_loop(upd, state, (bad, jnp.float32(LR)), short=2, long=7,
                                            reps=3)
    out["two slots, skipped step"] = (steady, batch, long)
    probe = jax.tree.leaves(state.mu)[0]
    seconds = read_ceiling(probe)
    ceiling = probe.nbytes / seconds / 1e12 if seconds else None
    del state
    return n, out, ceiling, profiles


def inplace_only(n_params, leaves, model_layers, reps, chunk_elems, gradient_checks,
                 parameter_checks):
    """optax.adamw (fp32 master weights, bf16 parameters cast after) and pimhbm.inplace (chunks
    of `chunk_elems`, non-finite gradients and damaged parameters found where `gradient_checks`
    and `parameter_checks` say) on the same tree, `reps` times in turn: [(optax s, in-place s)],
    steady seconds a step."""
    tree = ((lambda seed: model_tree(model_layers, jnp.bfloat16, seed)) if model_layers else
            (lambda seed: make_tree(n_params, leaves, jnp.bfloat16, seed)))
    params = tree(0)
    grads = jax.tree.map(lambda p: (p * 0.5 + 0.01).astype(jnp.bfloat16), tree(1))
    opt = inplace.adamw(LR, master_weights=True, chunk_elems=chunk_elems,
                        gradient_checks=gradient_checks, parameter_checks=parameter_checks)
    upd = jax.jit(lambda s, g, lr: opt.update(g, s, lr)[0], donate_argnums=0)
    pairs = []
    for rep in range(reps):
        plain, carry = optax_step(optax.adamw(LR), params, True)
        base = timed_loop(plain, carry, (grads,))[0]
        ours = timed_loop(upd, opt.init(params), (grads, jnp.float32(LR)))[0]
        print(f"rep {rep}: optax.adamw {base * 1e3:.3f} ms, pimhbm.inplace {ours * 1e3:.3f} ms, "
              f"{ours / base:.3f}x", flush=True)
        pairs.append((base, ours))
    return sum(p.size for p in jax.tree.leaves(params)), pairs


def print_profiles(console, kind, profiles):
    """Every kernel of a step (ms per step, launches) and the step's timeline, per variant."""
    for what, prof in profiles.items():
        if not prof["kernels"]:
            console.print(f"{kind}, {what}: the trace holds no device timeline (no GPU)")
            continue
        wall = prof["timeline"]
        t = Table(title=f"{kind}, {what}: kernels of one step (profiler, {PROFILE_STEPS} steps); "
                        f"span {wall['span']:.3f} ms, busy {wall['busy']:.3f}, "
                        f"idle {wall['idle']:.3f}")
        for col in ("kernel", "XLA op", "ms", "launches"):
            t.add_column(col, justify="left" if col in ("kernel", "XLA op") else "right")
        for name, op, ms, count in prof["kernels"]:
            t.add_row(name, op, f"{ms:.4f}", str(count))
        console.print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=268435456)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--model-layers", type=int, default=0, metavar="N",
                    help="instead of --params/--leaves: the leaves of N decoder layers of 8B "
                         "dimensions with their embedding, LM head and norms (`pimhbm llama3`'s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace optax.adamw and the guarded update into DIR and list the "
                         "kernels of their steps")
    ap.add_argument("--inplace-only", type=int, nargs="?", const=2, default=0, metavar="REPS",
                    help="only optax.adamw and the in-place update, bf16 + master, REPS times in "
                         "turn (default 2)")
    ap.add_argument("--chunk-elems", type=int, default=inplace.DEFAULT_CHUNK_ELEMS,
                    help="with --inplace-only: the in-place update's chunk (128, 256 or 512)")
    ap.add_argument("--gradient-checks", choices=options.CHECKS_WHERE,
                    default=options.CHECKS_WHERE[0],
                    help="with --inplace-only: where non-finite gradients are found (before the "
                         "writes: a pass over them; in the update: p's checks alone before it)")
    ap.add_argument("--parameter-checks", choices=options.CHECKS_WHERE,
                    default=options.CHECKS_WHERE[0],
                    help="with --inplace-only and --gradient-checks in-update: where damaged "
                         "parameter chunks are found (in the update: no pass before it at all)")
    args = ap.parse_args()
    console = Console(width=120)
    dev = jax.devices()[0]
    what = (f"{args.model_layers} decoder layers of 8B dimensions" if args.model_layers else
            f"{args.params / 1e6:.0f} M parameters in {args.leaves} tensors")
    payload = {"device": dev.device_kind, "params": args.params, "tree": what, "results": {}}
    if args.inplace_only:
        n, pairs = inplace_only(args.params, args.leaves, args.model_layers, args.inplace_only,
                                args.chunk_elems, options.gradient_checks(args.gradient_checks),
                                options.parameter_checks(args.parameter_checks))
        payload["params"], payload["chunk_elems"] = n, args.chunk_elems
        payload["gradient_checks"] = args.gradient_checks
        payload["parameter_checks"] = args.parameter_checks
        payload["results"]["bf16+master"] = [
            {"optax.adamw ms": b * 1e3, "pimhbm.inplace ms": o * 1e3, "ratio": o / b}
            for b, o in pairs]
        write_json(args.json, payload)
        return 0
    table = Table(title=f"AdamW step, {what}, {dev.device_kind} (steady: the slope between batches of 5 "
                        "and 25 steps, median of 7; the skipped step: 2 and 7, median of 3)")
    for col in ("state", "update", "ms", "effective TB/s", "vs optax.adamw", "of read ceiling",
                "ms a step of a batch (steps)", "batch vs optax.adamw"):
        table.add_column(col, justify="left" if col in ("state", "update") else "right")
    for kind in ("fp32", "bf16+master"):
        n, out, ceiling, profiles = bench_case(kind, args.params, args.leaves, args.profile,
                                               args.model_layers)
        if profiles:
            payload.setdefault("profiles", {})[kind] = profiles
            print_profiles(console, kind, profiles)
        base, base_batch, base_long = out["optax.adamw"]
        payload["results"][kind] = {k: {"ms": v * 1e3, "TB/s": BYTES_PER_PARAM * n / v / 1e12,
                                        "ms a step of a batch": b * 1e3, "batch steps": steps}
                                    for k, (v, b, steps) in out.items()}
        payload["results"][kind]["read ceiling TB/s"] = ceiling
        for k, (v, b, steps) in out.items():
            tbs = BYTES_PER_PARAM * n / v / 1e12
            table.add_row(kind, k, f"{v * 1e3:.3f}", f"{tbs:.2f}", f"{v / base:.3f}x",
                          f"{tbs / ceiling:.2f}" if ceiling else "-", f"{b * 1e3:.3f} ({steps})",
                          f"{b / base_batch:.3f}x" if steps == base_long else "-")
    console.print(table)
    for kind, res in payload["results"].items():
        for what in ("two slots (guarded)", "pimhbm.inplace (checks + update + parity)"):
            ratio = res[what]["ms"] / res["optax.adamw"]["ms"]
            console.print(f"{kind}: {what} {ratio:.3f}x the time of optax.adamw (steady), "
                          "target <= 1.05x: " + ("[green]met[/]" if ratio <= 1.05 else "[red]not met[/]"))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())

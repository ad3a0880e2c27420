"""Which ops of the Llama-3 step are not bit-repeatable on the GPU without XLA's deterministic
flag, and what the flag costs on each (issue 25: the table in bench/NOTES.md).

Each piece is a jitted function of fixed random inputs at Llama-3-8B dimensions (hidden 4096,
GQA 32/8 heads of 128, MLP 14336), run twice: its outputs compared bit for bit (the words that
differ, over every output) and its time taken. The gradients of a whole step mix every op's
non-determinism (a differing attention dQ reaches every weight below it), so the pieces are
also run alone: attention forward and backward (cuDNN's and XLA's), the embedding's gradient (a
gather's: a scatter-add), a norm weight's gradient (a column reduction over the tokens), a
linear layer's gradients, the loss. XLA's flag is read once per process, so the script runs
itself twice (flag off, then on) and prints both side by side.

usage: python bench/determinism_bisect.py [--tokens 16384] [--seq 4096] [--layers 2]
                                           [--vocab 8192] [--tiny] [--only REGEX] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any, Callable

FLAG = "--xla_gpu_deterministic_ops=true"


def pieces(args) -> dict[str, Callable[[], tuple[Callable, tuple]]]:
    """name -> a maker of (jitted function, its arguments); made lazily, one at a time."""
    import jax
    import jax.numpy as jnp

    import pimhbm
    from pimhbm.models import llama3

    cfg = (llama3.tiny(layers=args.layers, vocab=args.vocab) if args.tiny
           else llama3.llama3_8b(layers=args.layers, vocab=args.vocab))
    b, t = args.tokens // args.seq, args.seq
    key = iter(jax.random.split(jax.random.key(0), 64))
    normal = lambda shape, dt=jnp.bfloat16: jax.random.normal(next(key), shape, dt)

    def attention(impl):
        q, k, v = (normal((b, t, cfg.heads, cfg.head_dim)), normal((b, t, cfg.kv_heads, cfg.head_dim)),
                   normal((b, t, cfg.kv_heads, cfg.head_dim)))
        r = normal((b, t, cfg.heads, cfg.head_dim))
        attend = (pimhbm.attention if impl == llama3.PIMHBM_ATTENTION else
                  lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                               implementation=impl))
        f = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * r)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))), (q, k, v)

    def embedding(ordered):
        table, tokens = normal((cfg.vocab, cfg.hidden)), jax.random.randint(next(key), (b, t), 0, cfg.vocab)
        r = normal((b, t, cfg.hidden))
        f = lambda table: jnp.sum(llama3.embed(table, tokens, ordered).astype(jnp.float32) * r)
        return jax.jit(jax.grad(f)), (table,)

    def norm_weight():
        x, w, r = normal((b, t, cfg.hidden)), normal((cfg.hidden,)), normal((b, t, cfg.hidden))
        f = lambda w, x: jnp.sum(llama3.rms_norm(x, w, cfg.norm_eps).astype(jnp.float32) * r)
        return jax.jit(jax.grad(f, argnums=(0, 1))), (w, x)

    def linear():
        x, w, r = normal((b, t, cfg.hidden)), normal((cfg.intermediate, cfg.hidden)), normal((b, t, cfg.intermediate))
        f = lambda w, x: jnp.sum(jnp.einsum("bti,oi->bto", x, w).astype(jnp.float32) * r)
        return jax.jit(jax.grad(f, argnums=(0, 1))), (w, x)

    def cross_entropy():
        logits = normal((b, t, cfg.vocab), jnp.float32)
        tokens = jax.random.randint(next(key), (b, t), 0, cfg.vocab)

        def f(logits):
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(tokens, cfg.vocab, dtype=logp.dtype), -1))
        return jax.jit(jax.grad(f)), (logits,)

    def layer(impl):
        p = llama3.init(jax.random.key(1), cfg)["layers"][0]
        x, r = normal((b, t, cfg.hidden)), normal((b, t, cfg.hidden))
        f = lambda p, x: jnp.sum(llama3.decoder_layer(p, x, cfg, impl).astype(jnp.float32) * r)
        return jax.jit(jax.grad(f, argnums=(0, 1))), (p, x)

    def step(impl, ordered=False):
        params = llama3.init(jax.random.key(1), cfg)
        batch = {"tokens": jax.random.randint(next(key), (b, t + 1), 0, cfg.vocab)}
        return jax.jit(jax.grad(lambda p: llama3.loss(p, batch, cfg, impl, ordered))), (params,)

    return {
        "attention fwd+bwd, cuDNN": lambda: attention("cudnn"),
        "attention fwd+bwd, XLA": lambda: attention("xla"),
        "attention fwd+bwd, pimhbm": lambda: attention(llama3.PIMHBM_ATTENTION),
        "embedding gradient (scatter-add)": lambda: embedding(False),
        "embedding gradient, ordered (sort + scan)": lambda: embedding(True),
        "RMSNorm gradients (weight: a column sum)": norm_weight,
        "linear layer gradients (dW, dx)": linear,
        "log-softmax cross-entropy gradient": cross_entropy,
        "decoder layer fwd+bwd, cuDNN": lambda: layer("cudnn"),
        "decoder layer fwd+bwd, XLA": lambda: layer("xla"),
        f"whole loss gradient ({args.layers} layers), cuDNN": lambda: step("cudnn"),
        f"whole loss gradient ({args.layers} layers), XLA": lambda: step("xla"),
        f"whole loss gradient ({args.layers} layers), XLA, ordered embedding":
            lambda: step("xla", True),
        f"whole loss gradient ({args.layers} layers), cuDNN, ordered embedding":
            lambda: step("cudnn", True),
        f"whole loss gradient ({args.layers} layers), pimhbm, ordered embedding":
            lambda: step(llama3.PIMHBM_ATTENTION, True),
    }


def differing_words(a: Any, b: Any) -> tuple[int, int]:
    """Words (of each leaf's own width) that differ between two output trees, and all words."""
    import jax
    import numpy as np

    diff = total = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        width = np.dtype(f"u{x.dtype.itemsize}")
        diff += int(np.count_nonzero(x.view(width) != y.view(width)))
        total += x.size
    return diff, total


def child(args) -> None:
    """One process, one flag setting: each piece twice, compared, timed; a JSON line each."""
    import jax

    sys.path.insert(0, os.path.dirname(__file__))
    from common import time_jax

    for name, make in pieces(args).items():
        if args.only and not re.search(args.only, name):
            continue
        row = {"piece": name}
        try:
            fn, fn_args = make()
            first = jax.block_until_ready(fn(*fn_args))
            second = jax.block_until_ready(fn(*fn_args))
            row["differ"], row["words"] = differing_words(first, second)
            row["ms"] = 1e3 * time_jax(fn, *fn_args, iters=5, reps=3)
            del first, second, fn, fn_args
        except Exception as e:  # a piece that fails under a flag is a finding, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print("ROW " + json.dumps(row), flush=True)


def run_child(args, deterministic: bool) -> list[dict]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace(FLAG, "")
    env["XLA_FLAGS"] = (flags + " " + FLAG).strip() if deterministic else flags.strip()
    argv = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--seq",
            str(args.seq), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--only", args.only] if args.only else []
    print(f"running the pieces with XLA's deterministic flag {'on' if deterministic else 'off'} ...",
          flush=True)
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
    return rows


def cell(row: dict) -> tuple[str, str]:
    if row is None:
        return "-", "-"
    if "error" in row:
        return "fails", row["error"][:40]
    return f"{row['ms']:.2f}", f"{row['differ']:,} of {row['words']:,}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens a step")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the whole step")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a check of the script)")
    p.add_argument("--only", help="run only the pieces whose names match this regex")
    p.add_argument("--json", help="write both runs' rows here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    off, on = run_child(args, False), run_child(args, True)
    on_by = {r["piece"]: r for r in on}
    print(f"\n{'piece':48} {'ms':>8} {'words that differ':>24} | {'ms, flag':>9} {'differ, flag':>22}")
    for r in off:
        a, b = cell(r), cell(on_by.get(r["piece"]))
        print(f"{r['piece']:48} {a[0]:>8} {a[1]:>24} | {b[0]:>9} {b[1]:>22}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "flag_off": off, "flag_on": on}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

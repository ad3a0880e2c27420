"""``pimhbm gate``: prewarm from shapes (and the device memory that used), and the insulation
gate on injected NaN/Inf, forward and backward."""

from __future__ import annotations

import time
from typing import Any

from pimhbm_cli import options
from pimhbm_cli.options import non_negative_int, positive_int


def add_arguments(p) -> None:
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=positive_int, default=64, help="model width")
    p.add_argument("--nonfinite", type=non_negative_int, default=7, help="NaN/Inf to inject")
    p.add_argument("--seed", type=int, default=0, help="random seed")


def run(args: Any) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pimhbm
    from pimhbm.models import llama3

    console = options.console()
    dev = jax.devices()[0]
    cfg = llama3.tiny(layers=args.layers, hidden=args.hidden)
    opt = pimhbm.update.adamw(1e-3, master_weights=True, device_copy=True)

    # Prewarm: the protected step compiled from ShapeDtypeStructs only.
    shapes = llama3.abstract_params(cfg)
    state_shapes = jax.eval_shape(opt.init, shapes)
    batch = jax.ShapeDtypeStruct((8, 33), jnp.int32)

    def step(state, tokens):
        loss, grads = jax.value_and_grad(lambda p: llama3.loss(p, {"tokens": tokens}, cfg))(state.params)
        return opt.update(grads, state)

    before = dev.memory_stats() or {}
    t0 = time.perf_counter()
    compiled = [jax.jit(step, donate_argnums=0).lower(
        pimhbm.update.AdamWState(state_shapes.slots, c, state_shapes.step_copies, state_shapes.device_copy), batch).compile()
        for c in (0, 1)]
    seconds = time.perf_counter() - t0
    after = dev.memory_stats() or {}
    used = (after.get("bytes_in_use", 0) - before.get("bytes_in_use", 0)) if before else None
    console.print(f"prewarm: {len(compiled)} step programs (one per slot parity) for "
                  f"{cfg.num_params() / 1e6:.2f} M parameters compiled from shapes in {seconds:.1f} s; "
                  "device memory used: " + (f"{used} bytes" if used is not None else
                                            f"not reported by {dev.platform}"))

    # The gate: NaN/Inf injected into activations; none reaches the parameters' gradients.
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((64, cfg.hidden)).astype(np.float32)
    bad = rng.choice(x.size, args.nonfinite, replace=False)
    x.reshape(-1)[bad] = np.array([np.nan, np.inf, -np.inf])[np.arange(args.nonfinite) % 3]
    w = jnp.asarray(rng.standard_normal((cfg.hidden, cfg.hidden)).astype(np.float32))

    def loss(w, x, probe):
        h, fwd = pimhbm.insulate(x, probe)  # the injected NaN/Inf stop here
        y = jax.nn.relu(h @ w)
        y, _ = pimhbm.insulate(y, probe)
        # sqrt has an infinite derivative at 0: every unit relu zeroed sends an Inf cotangent
        # back, which the second gate zeros before it reaches w.
        return jnp.sum(jnp.sqrt(y)), fwd

    (value, fwd), (gw, gprobe) = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(
        w, jnp.asarray(x), pimhbm.probe())
    finite = bool(jnp.all(jnp.isfinite(gw)))
    console.print(f"gate: {args.nonfinite} NaN/Inf written into the activations; forward zeroed "
                  f"{int(fwd)}, backward zeroed {int(gprobe)} non-finite cotangents; loss "
                  f"{float(value):.4f}; weight gradient finite: {finite}")
    zeros = int(jnp.sum(jax.nn.relu(jnp.where(jnp.isfinite(x), x, 0) @ w) == 0))
    ok = (int(fwd) == args.nonfinite and int(gprobe) == zeros and finite and
          bool(np.isfinite(float(value))))
    console.print("[green]the gate held[/]" if ok else "[red]the gate let non-finite values through[/]")
    return 0 if ok else 1

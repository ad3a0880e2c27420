"""Which part of the demo's step makes its gradients non-finite on this device: the model's
gradients alone (both attentions), then through the in-graph injection hook (kind 0)."""
import jax
import jax.numpy as jnp
import numpy as np

from pimhbm import faults
from pimhbm_cli.data import corpus_bytes
from pimhbm.models import llama3
from pimhbm.train import text_batches

cfg = llama3.tiny(layers=2, hidden=64)
params = llama3.init(jax.random.key(0), cfg)
batch = {k: jnp.asarray(v) for k, v in text_batches(corpus_bytes(), 16, 64, 0)(1).items()}


def bad(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): int(jnp.sum(~jnp.isfinite(x.astype(jnp.float32))))
            for p, x in flat if int(jnp.sum(~jnp.isfinite(x.astype(jnp.float32))))}


for impl in ("xla", None):
    loss, g = jax.jit(jax.value_and_grad(lambda p, b: llama3.loss(p, b, cfg, impl)))(params, batch)
    print(f"attention {impl}: loss {float(loss):.4f}, non-finite gradients {bad(g)}", flush=True)
    spec = jnp.zeros(8, jnp.int32)
    g2 = jax.jit(lambda p, b: jax.tree.map(lambda x: faults.inject_in_graph(x, spec), jax.grad(
        lambda p, b: llama3.loss(p, b, cfg, impl))(p, b)))(params, batch)
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)))
    print(f"  through inject (kind 0): non-finite {bad(g2)}; bit-equal to without: {same}", flush=True)
    if not same:
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g2)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            d = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
            if d.size:
                print(f"    {jax.tree_util.keystr(p)} {a.shape}: {d.size} differ, first {d[:5]}, "
                      f"values {a.flat[d[:3]]} vs {b.flat[d[:3]]}")

import pimhbm  # noqa: E402

for chunk in (1024, 4096):
    opt = pimhbm.update.adamw(3e-3, weight_decay=0.01, master_weights=True, device_copy=True,
                       chunk_elems=chunk)
    state = jax.jit(opt.init)(params)
    jax.block_until_ready(state)
    new, report = jax.jit(lambda g, s: opt.update(g, s, jnp.float32(1e-4)), donate_argnums=1)(g, state)
    maps = {jax.tree_util.keystr(p): np.asarray(m) for p, m in
            jax.tree_util.tree_flatten_with_path(report.grad_nonfinite_maps)[0]}
    print(f"guarded update, chunk {chunk}: committed {bool(report.committed)}, non-finite "
          f"{int(report.grad_nonfinite)}, digest faults {int(report.digest_faults)}, maps "
          f"{ {k: m.tolist() for k, m in maps.items() if m.any()} }", flush=True)

from pimhbm.recovery import PersistentFault  # noqa: E402
from pimhbm.train import llama_trainer  # noqa: E402

for inject in (True, False):
    tr = llama_trainer(cfg, corpus_bytes(), steps=300, inject_gradients=inject,
                       attention_impl="xla", devices=jax.devices()[:1])
    tr.prewarm()
    try:
        stats = tr.run(3)
        print(f"trainer (inject_gradients={inject}): 3 steps, committed {stats.steps_committed}, "
              f"losses {stats.losses}", flush=True)
    except PersistentFault as e:
        print(f"trainer (inject_gradients={inject}): {str(e)[:300]}", flush=True)

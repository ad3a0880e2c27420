"""The user's batches as the engine carries them.

``batch_fn(step)`` may return any pytree of arrays; the engine logs, splits over devices and
replays a flat dict of arrays, keyed by each leaf's path (``jax.tree_util.keystr``), and the
loss gets the pytree back. With a PRNG key, every batch also carries a row ``(step, device)``
for each device, and the loss is called with ``fold_in(fold_in(key, step), device)``: a key of
its own for each step and each device's slice (dropout), that a replay -- or another device's
re-execution of the slice -- derives again bit for bit, since the row travels with the slice.
The engine's loss returns ``(loss, aux)``: the user's aux (``has_aux``), else None.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

# The batch entry that carries (step, device) rows; no leaf path can be spelled this way.
STEP_ROWS = "<step, device>"


class BatchFeed:
    """``batch_fn`` flattened (call it with a step), and the loss that takes what it makes."""

    def __init__(self, batch_fn: Callable[[int], Any], rng: jax.Array | None, devices: int,
                 has_aux: bool = False):
        self.batch_fn, self.rng, self.devices, self.has_aux = batch_fn, rng, devices, has_aux
        self.treedef: Any = None
        self.paths: list[str] = []  # the leaves' keys, in the pytree's order

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        return self.flatten(self.batch_fn(step), step)

    def flatten(self, batch: Any, step: int) -> dict[str, np.ndarray]:
        """``batch`` (step ``step``'s) as the engine carries it; its structure must be the first
        one's."""
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        if self.treedef is None:  # the paths once: every later batch has the same structure
            self.treedef = treedef
            self.paths = [jax.tree_util.keystr(path)
                          for path, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
        elif treedef != self.treedef:
            raise ValueError(f"batch_fn({step}) returned a batch of another structure than step "
                             f"1's: {treedef}, not {self.treedef}")
        flat = {path: np.asarray(x) for path, x in zip(self.paths, leaves)}
        if self.rng is not None:
            flat[STEP_ROWS] = np.array([[step, d] for d in range(self.devices)], np.int32)
        return flat

    def loss(self, loss_fn: Callable[..., Any]) -> Callable[[Any, dict], tuple[jax.Array, Any]]:
        """``loss_fn(params, batch)`` -- or ``loss_fn(params, batch, key)`` with a PRNG key --
        as the engine calls it: on a flat dict of this device's slice, returning (loss, aux)."""
        def flat_loss(params: Any, flat: dict) -> tuple[jax.Array, Any]:
            batch = jax.tree.unflatten(self.treedef, [flat[p] for p in self.paths])
            if self.rng is None:
                out = loss_fn(params, batch)
            else:
                step, device = flat[STEP_ROWS][0, 0], flat[STEP_ROWS][0, 1]
                out = loss_fn(params, batch,
                              jax.random.fold_in(jax.random.fold_in(self.rng, step), device))
            return out if self.has_aux else (out, None)
        return flat_loss

"""The gradients an update takes: checked against the parameters, and passed first through a
stateless optax transformation where the optimizer has one (``gradient_transform``)."""

from __future__ import annotations

from typing import Any

import jax


def check_grads(grads: Any, params: Any) -> None:
    """Gradients of the parameters' structure, each of its parameter's shape and dtype."""
    if jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError("gradients must have the structure of the parameters: "
                         f"{jax.tree.structure(params)}, got {jax.tree.structure(grads)}")
    for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params)):
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(f"gradient {jax.tree_util.keystr(path)} is {g.dtype}{tuple(g.shape)}; "
                             f"it must match its parameter, {p.dtype}{tuple(p.shape)}")


def check_transform(tx: Any, params: Any = None) -> None:
    """A gradient transformation: optax's kind and, for ``params``, stateless (its state would
    not be protected: no digest, no parity, no snapshot -- a repair or a replay could not put
    it back)."""
    if tx is None:
        return
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"gradient_transform must be an optax GradientTransformation (init, "
                        f"update), got {type(tx).__name__}")
    if params is not None and jax.tree.leaves(jax.eval_shape(tx.init, params)):
        raise ValueError("gradient_transform keeps a state of its own (e.g. a count or a moving "
                         "average), which would not be protected: only stateless transformations "
                         "of the gradients (clip_by_global_norm, masks, scaling) are supported")


def transform_grads(tx: Any, grads: Any, params: Any) -> Any:
    """``grads`` through the stateless gradient transformation ``tx`` (None: as they are),
    checked again against the parameters' structure, shapes and dtypes."""
    if tx is None:
        return grads
    grads, _ = tx.update(grads, tx.init(grads), None)
    check_grads(grads, params)
    return grads

"""``flax.nnx.Optimizer`` for the guarded in-place AdamW (``pimhbm.adamw``).

It has the shape of ``nnx.Optimizer`` as of flax 0.11 (checked against 0.12.12):
``Optimizer(model, tx, wrt=...)``, then ``update(model, grads, **kwargs)``, the model not kept.
The differences: ``wrt`` defaults to ``nnx.Param``; ``update`` returns the step's
``UpdateReport`` (the fused update makes no optax ``updates``); ``committed`` and ``repair``
are added. A full training loop::

    import jax.numpy as jnp, optax
    from flax import nnx
    import pimhbm, pimhbm.flax

    model = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(32, 1, rngs=nnx.Rngs(1)))
    optimizer = pimhbm.flax.Optimizer(model, pimhbm.adamw(1e-3))

    @nnx.jit(donate_argnums=(0, 1))  # donated: the update writes the parameters in place
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: optax.l2_loss(m(x), y).mean())(model)
        return loss, optimizer.update(model, grads)

    x, y = jnp.ones((16, 8)), jnp.zeros((16, 1))
    for _ in range(3):
        loss, report = train_step(model, optimizer, x, y)
    assert bool(report.committed) and int(optimizer.committed) == 3

A step that does not commit (a NaN gradient, a damaged parameter) leaves the model as it was
and says so in its report; damage the update itself finds (in the moments, or a parameter hit
after the backward pass) leaves its chunks to ``optimizer.repair(model, report)``, and the same
call rebuilds a parameter the checks before the update found damaged (that step's gradients
read the damage: run its batch again to replay it). The
parameters are held once, by the model: the state kept here is the ``AdamWState`` with
``params=None``, and each call lends it the model's. So change the parameters only through
``update``: others changed no longer match their digests, and every later update is refused
(``report.applied`` false, ``report.digest_faults`` set) until a new ``Optimizer`` is made.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pimhbm.inplace import AdamW, AdamWState, LeftChunks, RepairReport, UpdateReport

try:
    from flax import nnx
except ImportError as e:  # pimhbm itself never imports flax: only this module needs it
    raise ImportError("pimhbm.flax needs flax (tested with flax 0.12.12): pip install flax") from e


class Optimizer(nnx.Pytree):
    """The guarded AdamW of a model's ``wrt`` variables (float32 or bfloat16).

    ``step``: an ``nnx.OptState`` counting calls to ``update``, as ``nnx.Optimizer``'s does
    (a step that does not commit counts too); ``committed``: the steps that committed, the
    count the learning-rate schedule and the bias corrections use. ``opt_state``: an
    ``nnx.OptState`` holding the ``AdamWState`` without its parameters."""

    def __init__(self, model: Any, opt: AdamW, *, wrt: Any = nnx.Param):
        if not isinstance(opt, AdamW):
            raise TypeError(f"pimhbm.flax.Optimizer takes pimhbm.adamw(...), got "
                            f"{type(opt).__name__}; for an optax transformation use "
                            "flax.nnx.Optimizer")
        self.opt = opt
        self.wrt = wrt
        self.step = nnx.OptState(jnp.array(0, jnp.uint32))
        state = opt.init(nnx.as_pure(nnx.state(model, wrt)))
        self.opt_state = nnx.OptState(state._replace(params=None))

    @property
    def committed(self) -> jax.Array:
        return self.opt_state.get_value().step

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> UpdateReport:
        """One guarded step, writing the model's parameters (in place where the call donates
        them: ``nnx.jit(..., donate_argnums=...)``). ``grads``: as ``nnx.grad`` gives them;
        ``kwargs``: ``AdamW.update``'s (learning_rate, axis_name, gate). Where the report has
        ``digest_faults``, call :meth:`repair` with it before the next step (and where it was not
        ``applied``, run the step's batch again after it)."""
        grads = nnx.as_pure(nnx.state(grads, self.wrt))
        new, report = self.opt.update(grads, self._lent(model), **kwargs)
        self._take_back(model, new)
        self.step[...] += 1
        return report

    def repair(self, model: Any, report: UpdateReport | LeftChunks) -> RepairReport:
        """The chunks ``report``'s update left (damage it found) rebuilt from the parity and
        their update redone, and the parameter chunks a refused update's checks found damaged
        rebuilt, as ``AdamW.repair``."""
        new, fixed = self.opt.repair(self._lent(model), report)
        self._take_back(model, new)
        return fixed

    def _lent(self, model: Any) -> AdamWState:
        """The held state with the model's parameters in it, for one call."""
        held: AdamWState = self.opt_state.get_value()
        return held._replace(params=nnx.as_pure(nnx.state(model, self.wrt)))

    def _take_back(self, model: Any, new: AdamWState) -> None:
        nnx.update(model, new.params)
        self.opt_state.set_value(new._replace(params=None))

"""bench/precheck_order.py: the order of the in-place update's checks per leaf (a variant under
measurement), the check of a compiled module's reads, and the variant's step against the
library's one-pass checks."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
from precheck_order import checks_after, ordered_prechecks, reads_after_checks  # noqa: E402

from pimhbm import inplace  # noqa: E402

CHECK, UPDATE = "pimhbm_inplace_precheck", "pimhbm_adamw_inplace"


def mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2)


def params_of(rng):
    return {"w1": jnp.asarray(rng.standard_normal((32, 48)), jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((48, 16)), jnp.float32)}


def test_a_parameter_read_by_the_backward_pass_waits_for_the_gradient_that_follows_the_read(rng):
    params, x = params_of(rng), jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    leaves, treedef = jax.tree.flatten(params)  # w1, w2
    grads = lambda x, *ls: jax.value_and_grad(mlp_loss)(jax.tree.unflatten(treedef, ls), x)
    closed = jax.make_jaxpr(grads)(x, *leaves)
    # w2 is read again for the backward pass's dx, which only w1's gradient follows; w1's only
    # read (the forward pass) precedes both gradients, w2's first.
    assert checks_after(closed, 2, first=1) == [1, 0]
    with pytest.raises(ValueError, match="inputs"):
        checks_after(closed, 3, first=1)


def test_a_parameter_whose_reads_no_gradient_follows_is_checked_after_all_of_them():
    # Both forward reads feed only the loss; neither gradient depends on them.
    def loss(a, b):
        return jnp.sum(a @ a) + jnp.sum(b * 2.0)
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.ones((4, 4)),
                                                                      jnp.ones((4,)))
    assert checks_after(closed, 2) == [None, None]


def _step(order, beside=False):
    opt = inplace.adamw(1e-2)

    def step(state, x):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, x)
        new, report = opt.update(grads, state)
        return new, report.committed, loss

    kept = inplace.AdamW._prechecks
    inplace.AdamW._prechecks = kept if order is None else ordered_prechecks(order, beside)
    try:
        return opt, jax.jit(step, donate_argnums=0).lower(
            jax.eval_shape(opt.init, order_params[0]), order_params[1]).compile()
    finally:
        inplace.AdamW._prechecks = kept


order_params = []


def test_the_ordered_checks_give_the_one_pass_checks_results_bit_for_bit(rng):
    """On XLA's stream and beside it: the same state and report as the one pass."""
    params, x = params_of(rng), jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    order_params[:] = [params, x]
    opt, one_pass = _step(None)
    def damaged():  # w2 changed after its digest: the step must commit nothing
        state = opt.init(params)
        w2 = state.params["w2"]
        return state._replace(params={**state.params, "w2": w2.at[3, 4].set(w2[3, 4] + 1.0)})

    for fresh, commits in ((lambda: opt.init(params), 1), (damaged, 0)):
        a = one_pass(fresh(), x)
        assert int(a[1]) == commits
        for beside in (False, True):
            _, ordered = _step([1, 0], beside)
            b = ordered(fresh(), x)
            for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_the_module_check_finds_a_check_that_no_read_precedes(rng):
    order_params[:] = [params_of(rng), jnp.ones((8, 32), jnp.float32)]
    _, one_pass = _step(None)
    assert reads_after_checks(one_pass.as_text(), CHECK, (UPDATE,)) == []
    # Positive control: one check a leaf, each after its own gradient only -- w2's check
    # takes nothing from the backward pass's read of w2, which the module then runs after it
    # or beside it.
    _, unordered = _step([0, 1])
    late = reads_after_checks(unordered.as_text(), CHECK, (UPDATE,))
    assert {r.parameter for r in late} == {"%state_params__w2__.1"}
    assert reads_after_checks("HloModule m\n\nENTRY %e () -> f32[] {\n  ROOT %c = f32[] "
                              "constant(0)\n}\n", CHECK) is None

"""bench/check_order.py (a variant measured and kept out of the library): the order of the
in-place update's checks one a leaf, the check of a compiled program's reads, and the update
with that order against the library's one pass."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
from check_order import Ordered, checks_after, late_reads, plan_for  # noqa: E402

from pimhbm import inplace  # noqa: E402
from pimhbm.models import llama3  # noqa: E402


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


def compiled_step(params, x, order=None):
    """mlp_loss's step with pimhbm.adamw, its checks as ``order`` says (None: the one pass)."""
    opt = inplace.adamw(1e-2)
    variant = opt if order is None else Ordered.of(opt, order)

    def step(state, x):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, x)
        new, report = variant.update(grads, state)
        return new, report.committed, loss

    return opt, jax.jit(step, donate_argnums=0).lower(jax.eval_shape(opt.init, params),
                                                      x).compile()


def test_the_ordered_checks_give_the_one_pass_checks_results_bit_for_bit(rng):
    """The same state and report as the one pass, with and without a damaged parameter."""
    params, x = params_of(rng), jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    opt, one_pass = compiled_step(params, x)

    def damaged():  # w2 changed after its digest: the step must commit nothing
        state = opt.init(params)
        w2 = state.params["w2"]
        return state._replace(params={**state.params, "w2": w2.at[3, 4].set(w2[3, 4] + 1.0)})

    for fresh, commits in ((lambda: opt.init(params), 1), (damaged, 0)):
        a = one_pass(fresh(), x)
        assert int(a[1]) == commits
        _, ordered = compiled_step(params, x, [1, 0])
        b = ordered(fresh(), x)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_the_module_check_finds_a_check_that_no_read_precedes(rng):
    params, x = params_of(rng), jnp.ones((8, 32), jnp.float32)
    _, one_pass = compiled_step(params, x)
    assert late_reads(one_pass.as_text()) == []
    # Positive control: one check a leaf, each after its own gradient only -- w2's check
    # takes nothing from the backward pass's read of w2, which the module then runs after it.
    _, unordered = compiled_step(params, x, [0, 1])
    late = late_reads(unordered.as_text())
    assert {r.parameter for r in late} == {"%state_params__w2__.1"}
    assert late_reads("HloModule m\n\nENTRY %e () -> f32[] {\n  ROOT %c = f32[] "
                      "constant(0)\n}\n") is None


def test_a_plan_names_every_leaf_and_only_gradients_there_are():
    opt = inplace.adamw(1e-2)
    params = {"w": jnp.ones((4, 4))}
    for after in ((0, 0), (1,)):
        with pytest.raises(ValueError, match="each None or a gradient's index; the parameters "
                                             "have 1"):
            jax.jit(lambda s, g: Ordered.of(opt, after).update(g, s))(opt.init(params), params)


def test_plan_for_a_llama_step_orders_every_product_weight_inside_the_backward_pass():
    cfg = llama3.tiny(layers=2)
    params = llama3.abstract_params(cfg)
    batch = {"tokens": jnp.zeros((2, 17), jnp.int32)}
    plan = plan_for(jax.value_and_grad(lambda p: llama3.loss(p, batch, cfg)), params)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    after = dict(zip(names, plan))
    assert len(plan) == len(names)
    # A product's weight is read again for the backward pass's dx: its check follows a gradient
    # of the layer below it (down_proj's dx feeds up_proj's gradient); a norm's weight enters
    # the residual stream's elementwise chain, which XLA may recompute up to the backward
    # pass's end: checked after every gradient.
    assert names[after["['layers'][1]['down_proj']"]] == "['layers'][1]['up_proj']"
    assert after["['norm']"] is None

"""pimhbm.check_order: the order of the in-place update's checks one a leaf, the check of a
compiled program's reads, and the update with a plan against the one pass."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimhbm import check_order, inplace
from pimhbm.campaign import KINDS, Campaign
from pimhbm.check_order import CheckPlan, checks_after, late_reads, plan_for
from pimhbm.models import llama3, mlp
from pimhbm.recovery import Trainer
from pimhbm.recovery import trainer as trainer_module


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


def compiled_step(params, x, order=None, beside=False):
    """mlp_loss's step with pimhbm.adamw, its checks as ``order`` says (None: the one pass)."""
    opt = inplace.adamw(1e-2)
    plan = None if order is None else CheckPlan(tuple(order), beside)

    def step(state, x):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, x)
        new, report = opt.update(grads, state, check_plan=plan)
        return new, report.committed, loss

    return opt, jax.jit(step, donate_argnums=0).lower(jax.eval_shape(opt.init, params),
                                                      x).compile()


def test_the_ordered_checks_give_the_one_pass_checks_results_bit_for_bit(rng):
    """On XLA's stream and beside it: the same state and report as the one pass."""
    params, x = params_of(rng), jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    opt, one_pass = compiled_step(params, x)

    def damaged():  # w2 changed after its digest: the step must commit nothing
        state = opt.init(params)
        w2 = state.params["w2"]
        return state._replace(params={**state.params, "w2": w2.at[3, 4].set(w2[3, 4] + 1.0)})

    for fresh, commits in ((lambda: opt.init(params), 1), (damaged, 0)):
        a = one_pass(fresh(), x)
        assert int(a[1]) == commits
        for beside in (False, True):
            _, ordered = compiled_step(params, x, [1, 0], beside)
            b = ordered(fresh(), x)
            for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_the_module_check_finds_a_check_that_no_read_precedes(rng):
    params, x = params_of(rng), jnp.ones((8, 32), jnp.float32)
    _, one_pass = compiled_step(params, x)
    assert late_reads(one_pass.as_text()) == []
    # Positive control: one check a leaf, each after its own gradient only -- w2's check
    # takes nothing from the backward pass's read of w2, which the module then runs after it
    # or beside it.
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
            jax.jit(lambda s, g: opt.update(g, s, check_plan=CheckPlan(after)))(
                opt.init(params), params)


def test_plan_for_a_llama_step_orders_every_product_weight_inside_the_backward_pass():
    cfg = llama3.tiny(layers=2)
    params = llama3.abstract_params(cfg)
    batch = {"tokens": jnp.zeros((2, 17), jnp.int32)}
    plan = plan_for(jax.value_and_grad(lambda p: llama3.loss(p, batch, cfg)), params)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    after = dict(zip(names, plan.after))
    assert plan.beside and len(plan.after) == len(names)
    # A product's weight is read again for the backward pass's dx: its check follows a gradient
    # of the layer below it (down_proj's dx feeds up_proj's gradient); a norm's weight enters
    # the residual stream's elementwise chain, which XLA may recompute up to the backward
    # pass's end: checked after every gradient.
    assert names[after["['layers'][1]['down_proj']"]] == "['layers'][1]['up_proj']"
    assert after["['norm']"] is None


READ = object()  # the check of the compiled step's order as it is


def trainer_run(name, monkeypatch, *, beside, late=READ, steps=14):
    """A one-copy Trainer on the CPU under a campaign of every kind: ``beside`` asks for the
    checks beside the backward pass (allowed on the CPU here); ``late``: what the check of the
    compiled step's order finds instead of what it reads there."""
    monkeypatch.setattr(trainer_module, "_beside_possible", lambda devices: True)
    if late is not READ:
        monkeypatch.setattr(check_order, "late_reads", lambda hlo: late)
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=128, group=4)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                 inject_gradients=True, devices=jax.devices()[:1], checks_beside=beside)
    try:
        tr.prewarm()
        campaign = Campaign(tr, {k: 1 for k in KINDS}, last_step=steps - 2, seed=5)
        stats = tr.run(steps, campaign=campaign)
        return tr.checks_beside, tr.current_state(), campaign.check(stats), stats
    finally:
        tr.close(unlink=True)


def test_a_trainer_with_the_checks_beside_ends_bit_identical_to_the_one_pass(shm_name,
                                                                           monkeypatch):
    """The compiled step keeps the plan's order here (checked on its text): the step runs with
    one check a leaf, under a campaign of every kind, and ends as the one pass does."""
    on, state, found, stats = trainer_run(shm_name, monkeypatch, beside=True)
    assert on
    assert all(r["missed"] == 0 for r in found.values()), found
    assert stats.compiles_after_prewarm == 0
    off, reference, _, _ = trainer_run(shm_name + "_ref", monkeypatch, beside=False)
    assert not off
    assert state.keys() == reference.keys()
    assert all(state[k].tobytes() == reference[k].tobytes() for k in state)


@pytest.mark.parametrize("late", [[check_order.LateRead("%c", "%state_params_w0", "%dot")], None],
                         ids=["a_late_read", "no_check_found"])
def test_a_step_that_does_not_keep_the_order_falls_back_to_the_one_pass(shm_name, monkeypatch,
                                                                        caplog, late):
    with caplog.at_level(logging.WARNING, logger="pimhbm.recovery.programs"):
        on, _, found, _ = trainer_run(shm_name, monkeypatch, beside=True, steps=4, late=late)
    assert not on
    assert ("reads %state_params_w0 after its check" if late else "has none") in caplog.text
    assert all(r["missed"] == 0 for r in found.values()), found

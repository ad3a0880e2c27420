"""pimhbm.inplace.adamw among JAX's libraries: its state saved and restored by orbax, and
pimhbm.flax.Optimizer in place of flax.nnx.Optimizer (CPU). Each test is skipped where its
library is not installed."""

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from pimhbm import inplace
from test_update import random_grads, random_params

LR, WD = 1e-3, 1e-4
# A few whole parity groups (16 chunks of the default size; in one short block, dealt over its
# groups) and a leaf of one chunk: the defaults' parity is 1/16 of the state; a small leaf pads
# its chunk and its row.
SHAPES = ((64, 256), (256,), (256, 64))
KINDS = ["fp32", "bf16_master_no_parity"]  # one leaves master None, the other parity None


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def orbax():
    return pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed "
                               "(pip install orbax-checkpoint)")


def flax_nnx():
    return pytest.importorskip("flax.nnx", reason="flax is not installed (pip install flax)")


def trained(rng, kind, steps=3):
    """The optimizer, the parameters and the state after ``steps`` committed updates."""
    master = kind == "bf16_master_no_parity"
    opt = inplace.adamw(LR, weight_decay=WD, master_weights=master,
                        group=0 if master else inplace.DEFAULT_GROUP)
    params = random_params(rng, ml_dtypes.bfloat16 if master else np.float32, SHAPES)
    update = jax.jit(opt.update, donate_argnums=1)
    state = opt.init(params)
    for _ in range(steps):
        state, report = update(random_grads(rng, params), state)
        assert bool(report.committed)
    return opt, params, state, update


# -- orbax ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_orbax_checkpoint_restores_the_state_bit_for_bit_and_training_goes_on(rng, tmp_path,
                                                                                   kind):
    ocp = orbax()
    opt, params, state, update = trained(rng, kind)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(opt.init, params))
    assert isinstance(restored, inplace.AdamWState)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert bits(restored) == bits(state) and int(restored.step) == 3
    grads, before = random_grads(rng, params), bits(state)
    resumed, resumed_report = update(grads, restored)
    went_on, went_on_report = update(grads, state)
    assert bool(resumed_report.committed) and int(resumed.step) == 4
    assert bits(resumed) == bits(went_on) and bits(resumed_report) == bits(went_on_report)
    assert bits(resumed) != before  # the step changed the state: the equality says something


def optax_bytes(kind, params):
    """optax.adamw's state and what it updates: the parameters and, for bf16 parameters with
    fp32 master weights, the master copy (optax's state is then that of the master)."""
    updated = params
    if kind == "bf16_master_no_parity":
        updated = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        params = (params, updated)
    state = jax.eval_shape(optax.adamw(LR, weight_decay=WD).init, updated)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, state)))


@pytest.mark.parametrize("kind", KINDS)
def test_an_orbax_checkpoint_holds_the_state_once(rng, tmp_path, kind):
    ocp = orbax()
    _, params, state, _ = trained(rng, kind, steps=1)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        saved = checkpointer.metadata(tmp_path / "state").item_metadata.tree
    arrays = jax.tree.leaves(saved)
    assert len(arrays) == len(jax.tree.leaves(state))
    ours = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)
    theirs = optax_bytes(kind, params)
    assert ours <= 1.10 * theirs, ours / theirs
    assert 2 * ours > 1.10 * theirs  # the bound would catch the state saved twice


# -- flax -------------------------------------------------------------------------------------


def mlp(nnx, seed):
    rngs = nnx.Rngs(seed)
    return nnx.Sequential(nnx.Linear(16, 64, rngs=rngs), nnx.relu, nnx.Linear(64, 8, rngs=rngs))


def batches(rng, n):
    return [(jnp.asarray(rng.standard_normal((32, 16), np.float32)),
             jnp.asarray(rng.standard_normal((32, 8), np.float32))) for _ in range(n)]


def train_step(nnx, **jit):
    """A compiled step for either optimizer: the loss and what its update returned."""
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        return loss, optimizer.update(model, grads)
    return nnx.jit(step, **jit)


def params_of(nnx, model):
    return jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("clip", [None, 0.05], ids=["adamw", "clip-then-adamw"])
def test_the_flax_optimizer_follows_nnx_optimizer_with_optax_adamw(rng, clip):
    """Five steps against nnx.Optimizer(optax.adamw) -- with a gradient clip first, against
    optax.chain(clip, adamw) -- to a few float32 ulps of the parameters (rtol 1e-6, atol 1e-7;
    an ulp is 6e-8 at 0.5), not bit for bit: optax divides by the bias corrections where the
    fused update multiplies by their reciprocals, XLA fuses optax's multiply-adds, and each
    step's gradient inherits the last step's rounding."""
    nnx = flax_nnx()
    import pimhbm.flax
    seed = int(rng.integers(2**31))
    ours, theirs = mlp(nnx, seed), mlp(nnx, seed)
    first = optax.clip_by_global_norm(clip) if clip else None
    optimizer = pimhbm.flax.Optimizer(ours, inplace.adamw(LR, weight_decay=WD,
                                                          gradient_transform=first))
    tx = optax.adamw(LR, weight_decay=WD)
    reference = nnx.Optimizer(theirs, optax.chain(first, tx) if first else tx, wrt=nnx.Param)
    step = train_step(nnx)
    start = [np.asarray(p) for p in params_of(nnx, ours)]
    for i, (x, y) in enumerate(batches(rng, 5)):
        loss, report = step(ours, optimizer, x, y)
        want, _ = step(theirs, reference, x, y)
        assert bool(report.committed), i
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    assert int(optimizer.step[...]) == int(optimizer.committed) == int(reference.step[...]) == 5
    for got, want, was in zip(params_of(nnx, ours), params_of(nnx, theirs), start, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
        # Five steps of 1e-3 moved every tensor far beyond the tolerance.
        assert np.abs(np.asarray(got) - was).max() > 1e-3


def test_a_nan_gradient_leaves_the_flax_model_bit_identical(rng):
    nnx = flax_nnx()
    import pimhbm.flax
    model = mlp(nnx, int(rng.integers(2**31)))
    optimizer = pimhbm.flax.Optimizer(model, inplace.adamw(LR, weight_decay=WD))
    step = train_step(nnx)
    (x, y), (x2, y2) = batches(rng, 2)
    step(model, optimizer, x, y)
    params_before, state_before = bits(params_of(nnx, model)), bits(optimizer.opt_state.get_value())
    bad = x.at[int(rng.integers(32)), int(rng.integers(16))].set(jnp.nan)
    loss, report = step(model, optimizer, bad, y)
    assert np.isnan(float(loss)) and int(report.grad_nonfinite) > 0
    assert not bool(report.applied) and not bool(report.committed)
    assert bits(params_of(nnx, model)) == params_before
    assert bits(optimizer.opt_state.get_value()) == state_before
    assert int(optimizer.step[...]) == 2 and int(optimizer.committed) == 1
    _, report = step(model, optimizer, x2, y2)  # a finite step then commits and writes
    assert bool(report.committed) and int(optimizer.committed) == 2
    assert bits(params_of(nnx, model)) != params_before


def test_a_donating_nnx_jit_step_updates_the_model_in_place_as_a_plain_one(rng):
    """Donated, the parameters' buffers become the update's (the old ones are gone); the
    results are those of the step that does not donate, bit for bit."""
    nnx = flax_nnx()
    import pimhbm.flax
    seed = int(rng.integers(2**31))
    models = [mlp(nnx, seed) for _ in range(2)]
    optimizers = [pimhbm.flax.Optimizer(m, inplace.adamw(LR, weight_decay=WD)) for m in models]
    plain, donating = train_step(nnx), train_step(nnx, donate_argnums=(0, 1))
    for x, y in batches(rng, 3):
        old = params_of(nnx, models[1])
        plain(models[0], optimizers[0], x, y)
        _, report = donating(models[1], optimizers[1], x, y)
        assert bool(report.committed) and all(p.is_deleted() for p in old)
    assert bits(params_of(nnx, models[0])) == bits(params_of(nnx, models[1]))
    assert bits(optimizers[0].opt_state.get_value()) == bits(optimizers[1].opt_state.get_value())


def test_parameters_changed_outside_the_flax_optimizer_are_refused(rng):
    """The model's parameters are the optimizer's: one written behind its back fails its digest
    and the update writes nothing; a new Optimizer takes the parameters as they are."""
    nnx = flax_nnx()
    import pimhbm.flax
    model = mlp(nnx, int(rng.integers(2**31)))
    optimizer = pimhbm.flax.Optimizer(model, inplace.adamw(LR, weight_decay=WD))
    step = train_step(nnx)
    (x, y), = batches(rng, 1)
    model.layers[0].kernel[...] = model.layers[0].kernel[...] * 2
    before = bits(params_of(nnx, model))
    _, report = step(model, optimizer, x, y)
    assert not bool(report.applied) and int(report.digest_faults) > 0
    assert bits(params_of(nnx, model)) == before
    optimizer = pimhbm.flax.Optimizer(model, inplace.adamw(LR, weight_decay=WD))
    _, report = step(model, optimizer, x, y)
    assert bool(report.committed) and bits(params_of(nnx, model)) != before


def twin_runs(nnx, rng, steps):
    """Two equal models and optimizers: the first trained on all ``steps`` batches (the run
    without faults), the second on the first batch only (the run a fault is put into)."""
    import pimhbm.flax
    seed = int(rng.integers(2**31))
    models = [mlp(nnx, seed) for _ in range(2)]
    optimizers = [pimhbm.flax.Optimizer(m, inplace.adamw(LR, weight_decay=WD)) for m in models]
    step = train_step(nnx)
    data = batches(rng, steps)
    for x, y in data:
        step(models[0], optimizers[0], x, y)
    step(models[1], optimizers[1], *data[0])
    return models, optimizers, step, data


def test_damage_the_flax_update_finds_is_repaired_as_if_it_never_was(rng):
    """A bit flipped in a moment: the update leaves its chunk, repair rebuilds it and redoes
    its update; the model and the state are then those of the run without the flip."""
    nnx = flax_nnx()
    models, optimizers, step, data = twin_runs(nnx, rng, 3)
    held = optimizers[1].opt_state.get_value()
    mu = [np.asarray(m).copy() for m in jax.tree.leaves(held.mu)]
    leaf = int(rng.integers(len(mu)))
    word = mu[leaf].reshape(-1).view(np.uint32)
    word[int(rng.integers(word.size))] ^= np.uint32(1 << int(rng.integers(32)))
    held = held._replace(mu=jax.tree.unflatten(jax.tree.structure(held.mu), map(jnp.asarray, mu)))
    optimizers[1].opt_state.set_value(held)
    _, report = step(models[1], optimizers[1], *data[1])
    assert bool(report.applied) and int(report.digest_faults) == 1 and int(report.stashed) == 1
    fixed = optimizers[1].repair(models[1], report)
    assert bool(fixed.complete)
    step(models[1], optimizers[1], *data[2])
    assert bits(params_of(nnx, models[1])) == bits(params_of(nnx, models[0]))
    assert bits(optimizers[1].opt_state.get_value()) == bits(optimizers[0].opt_state.get_value())


def test_a_damaged_flax_parameter_is_rebuilt_by_repair_and_its_step_replayed(rng):
    """A bit flipped in a parameter between steps: the update is refused (its gradients read
    the damage), repair with its report rebuilds the chunk from the parity, and the step run
    again ends as the run without the flip."""
    nnx = flax_nnx()
    models, optimizers, step, data = twin_runs(nnx, rng, 2)
    kernel = np.asarray(models[1].layers[2].kernel[...]).copy()
    words = kernel.reshape(-1).view(np.uint32)
    words[int(rng.integers(words.size))] ^= np.uint32(1 << int(rng.integers(32)))
    models[1].layers[2].kernel[...] = jnp.asarray(kernel)
    _, report = step(models[1], optimizers[1], *data[1])
    assert not bool(report.applied) and int(report.digest_faults) == 1
    fixed = optimizers[1].repair(models[1], report)
    assert bool(fixed.complete)
    step(models[1], optimizers[1], *data[1])  # the refused step, run again
    assert bits(params_of(nnx, models[1])) == bits(params_of(nnx, models[0]))
    assert bits(optimizers[1].opt_state.get_value()) == bits(optimizers[0].opt_state.get_value())


def test_the_flax_module_example_runs():
    flax_nnx()
    import pimhbm.flax
    lines = pimhbm.flax.__doc__.split("::\n", 1)[1].splitlines()
    block = []
    for line in lines:  # the indented block after "::"
        if line and not line.startswith(" "):
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    assert "train_step(model, optimizer, x, y)" in code  # the whole example, not a part
    exec(compile(code, "pimhbm/flax.py example", "exec"), {})


def test_importing_pimhbm_does_not_import_flax_and_pimhbm_flax_says_how_to_get_it():
    """In a fresh interpreter; flax made unimportable for the second half."""
    code = ("import sys; import pimhbm; assert 'flax' not in sys.modules, 'flax imported'; "
            "sys.modules['flax'] = None\n"
            "try:\n    import pimhbm.flax\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pip install flax" in out.stdout

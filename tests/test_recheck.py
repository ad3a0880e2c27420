"""Sampled re-execution: a finite wrong value in one device's gradients before the reduction
reaches every replica alike (no digest, no replica can see it). On a sampled step each
device's slice is computed again on the next device and the digests compared bit for bit."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pimhbm
from conftest import uninterrupted_state
from pimhbm import faults
from pimhbm.models import mlp
from pimhbm.recovery import Action, DeviceFailure, IncidentKind, Trainer

STEPS, EVERY = 16, 5


def make_trainer(name):
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                 scrub_every=5, telemetry=None, inject_gradients=True, recheck_every=EVERY,
                 devices=jax.devices()[:4])
    tr.prewarm()
    return tr


@pytest.fixture(scope="module")
def uninterrupted():
    return uninterrupted_state(make_trainer, STEPS)


class FiniteFlip:
    """One of the top three mantissa bits of one bf16 gradient value of w1 flipped on ``device``
    before the reduction, at each of ``steps`` (first attempts only: a transient fault). The
    element is drawn from ``elements`` (a count, or the candidates themselves)."""

    def __init__(self, rng, steps, device, elements=96 * 96):
        self.steps, self.device = steps, device
        self.element, self.bit = int(rng.choice(elements)), int(rng.integers(4, 7))

    def before_step(self, trainer, step, attempt):
        if step not in self.steps or attempt != 1:
            return None
        spec = faults.spec(faults.FLIP_BIT, offset=2 * self.element, bit=self.bit)
        return faults.GradientFault(trainer.paths.index("w1"), spec, self.device)

    def before_scrub(self, trainer, step):
        pass


def elements_that_outweigh_the_sum(step, device):
    """w1's elements whose gradient on ``device`` at ``step`` is at least the sum over the
    devices in size (and not zero): a flip of a top mantissa bit there moves the sum by at least
    1/16 of it, far above its bf16 rounding. Elsewhere the flip can vanish in the sum (about 2 %
    of the draws did), and the control would pass with no fault. Computed on the host from the
    fault-free state the step starts from; the margin of 8x covers any difference in rounding."""
    state = uninterrupted_state(make_trainer, step - 1)
    params = {k.removesuffix("/p"): v for k, v in state.items() if k.endswith("/p")}
    batch, rows = mlp.batches(0)(step), 64 // 4  # each device's slice: its block of rows
    grads = np.stack([
        np.asarray(jax.grad(mlp.loss)(params, {k: v[d * rows:(d + 1) * rows]
                                               for k, v in batch.items()})["w1"]
                   .astype(jnp.bfloat16), np.float32).ravel() for d in range(4)])
    own = np.abs(grads[device])
    return np.flatnonzero((own >= np.abs(grads.sum(axis=0))) & (own > 1e-30))


def same_state(a, b):
    return all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_a_finite_flip_on_a_sampled_step_is_found_and_replayed(shm_name, rng, uninterrupted):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    tr = make_trainer(shm_name)
    stats = tr.run(STEPS, campaign=FiniteFlip(rng, {10}, device=2))
    found = [i for i in stats.incidents if i.kind is IncidentKind.COMPUTE]
    assert [(i.step, i.devices, i.action) for i in found] == [
        (10, (2,), Action.SKIPPED_AND_REPLAYED)]
    assert [i.kind for i in stats.incidents] == [IncidentKind.COMPUTE]  # nothing else saw it
    assert tr.compiles == 0 and same_state(tr.current_state(), uninterrupted)
    tr.close()


def test_off_the_sampled_steps_the_same_flip_goes_unseen(shm_name, rng, uninterrupted):
    """The control: the flip on a step that is not sampled passes every other check."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    candidates = elements_that_outweigh_the_sum(12, device=2)
    assert len(candidates) > 100  # a real draw, not a handful of elements
    tr = make_trainer(shm_name)
    stats = tr.run(STEPS, campaign=FiniteFlip(rng, {12}, device=2, elements=candidates))
    assert stats.incidents == [] and not same_state(tr.current_state(), uninterrupted)
    tr.close()


def test_a_device_whose_gradients_differ_twice_ends_the_run(shm_name, rng):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    tr = make_trainer(shm_name)
    with pytest.raises(DeviceFailure, match="device 1 computed gradients .* twice") as err:
        tr.run(STEPS, campaign=FiniteFlip(rng, {5, 10}, device=1))
    assert err.value.device == 1
    tr.close()


def test_a_fault_free_llama_agrees_with_its_re_execution_on_every_step():
    """Every step of a tiny Llama sampled on one device: the re-execution inside the step and
    the step's own gradients must agree bit for bit. (When the re-execution's loss was dead, XLA
    compiled its copy otherwise and from step 22 on every sampled step differed: a false
    DeviceFailure.) The control: a finite flip on one step is still told apart."""
    from pimhbm.models import llama3
    from pimhbm.train import llama_trainer
    cfg = llama3.tiny(layers=2, vocab=256)
    data = bytes(range(256)) * 2000
    tr = llama_trainer(cfg, data, steps=100, batch=4, seq=64, telemetry=None, recheck_every=1,
                       snapshot_every=0, scrub_every=0, inject_gradients=True,
                       devices=jax.devices()[:1])
    tr.prewarm()
    stats = tr.run(30)
    assert stats.incidents == [] and stats.steps_committed == 30
    flip = faults.spec(faults.FLIP_BIT, offset=2 * 7, bit=5)
    hook = lambda trainer, step, attempt: (faults.GradientFault(trainer.paths.index("norm"), flip, 0)
                                           if step == 33 and attempt == 1 else None)
    campaign = type("Once", (), {"before_step": staticmethod(hook),
                                 "before_scrub": staticmethod(lambda trainer, step: None)})()
    stats = tr.run(36, campaign=campaign)
    assert [i.step for i in stats.incidents if i.kind is IncidentKind.COMPUTE] == [33]

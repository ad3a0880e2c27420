"""Steps the in-place update applies in part, on the CPU: with the gradients checked in the
update (pimhbm.inplace.GradientChecks.IN_UPDATE) a non-finite gradient value, and in either mode
new values that are not finite (eps 0 where a moment is 0), are kept while every other element
is written. The host and the device agree that such a step did not commit; the Trainer takes
the host snapshot and replays; what comes back on every replay ends the run with an error that
names it. A step whose learning rate is not finite runs nothing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pimhbm
from pimhbm import inplace
from pimhbm.campaign import KINDS, Campaign
from pimhbm.models import mlp
from pimhbm.recovery import Action, IncidentKind, Trainer
from pimhbm.recovery.one_copy import OneCopy
from conftest import nan_at_step, needs_devices
from one_copy_trainer import (CHUNK, GROUP, NoEndlessReplay, Once, fault_free, flip, incidents,
                              make_trainer, same_state)


@pytest.mark.parametrize("devices,shard,group", [(1, 1, GROUP), (4, 2, GROUP)],
                         ids=["1-device-parity", "fsdp-2x2-parity"])
def test_gradients_checked_in_the_update_restore_a_step_applied_in_part(shm_name, devices, shard,
                                                                      group):
    """GradientChecks.IN_UPDATE: the checks before the writes read p alone, so a non-finite
    gradient value reaches the update, which applies the step in part; the Trainer takes the
    state from the host snapshot and replays. The campaign of every kind still ends with the
    fault-free run's state (run with the checks before the writes: the same arithmetic), every
    gradient fault repaired that way and the state's own faults as before."""
    needs_devices(devices)
    steps = 24
    kw = dict(devices=devices, shard=shard, group=group)
    reference = fault_free(shm_name, steps, **kw)
    tr = make_trainer(shm_name, inject=True, gradient_checks=inplace.GradientChecks.IN_UPDATE,
                      **kw)
    try:
        campaign = Campaign(tr, {k: 2 for k in KINDS}, last_step=steps - 2, seed=3)
        stats = tr.run(steps, campaign=campaign)
        found = campaign.check(stats)
        assert all(r["missed"] == 0 and r["repaired"] == r["injected"] for r in found.values()), found
        assert stats.compiles_after_prewarm == 0
        assert same_state(tr.current_state(), reference)
        restored = incidents(stats, IncidentKind.GRADIENT, Action.RESTORED_FROM_SNAPSHOT)
        assert restored and found["grad_nonfinite"]["detected"] >= 1
        assert not incidents(stats, IncidentKind.GRADIENT, Action.SKIPPED_AND_REPLAYED)
        assert incidents(stats, IncidentKind.STATE, Action.REDONE_FROM_PARITY)
    finally:
        tr.close(unlink=True)


def test_gradients_checked_in_the_update_need_a_host_snapshot(shm_name):
    opt = inplace.adamw(3e-3, chunk_elems=CHUNK, gradient_checks=inplace.GradientChecks.IN_UPDATE)
    with pytest.raises(ValueError, match="host snapshot: pass shm_name"):
        Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), devices=jax.devices()[:1])
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), devices=jax.devices()[:1],
                 shm_name=shm_name, snapshot_every=5)
    try:
        with pytest.raises(ValueError, match="snapshot_every > 0"):
            tr.snapshot_every = 0
        tr.snapshot_every = 7  # the control: a positive interval is taken
        assert tr.snapshot_every == 7
    finally:
        tr.close(unlink=True)


@pytest.mark.parametrize("loss_gate", [True, False], ids=["loss-gate", "control-no-gate"])
def test_gradients_checked_in_the_update_stop_a_step_that_fails_on_every_replay(
        shm_name, monkeypatch, loss_gate):
    """A NaN in step 7's batch, so its loss is NaN on every replay: the loss holds the step
    before any write, and after max_skips skips (no host restore) the run stops with an error
    that names the loss. The control, with the loss's gate taken out: each time the update
    applies the step in part and the Trainer restores the snapshot of step 5 and replays --
    step 6 commits on every replay, which must not reset step 7's count."""
    if not loss_gate:
        monkeypatch.setattr(OneCopy, "_nonfinite_loss", lambda self, loss: jnp.int32(0))
    batch_fn = nan_at_step(mlp.batches(0), 7)
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP,
                        gradient_checks=inplace.GradientChecks.IN_UPDATE)
    tr = Trainer(mlp.loss, opt, mlp.init(0), batch_fn, shm_name=shm_name, snapshot_every=5,
                 max_skips=3, devices=jax.devices()[:1])
    try:
        tr.prewarm()
        with pytest.raises(pimhbm.recovery.PersistentFault,
                           match="step 7 was skipped 3 times") as err:
            tr.run(12, campaign=NoEndlessReplay(7, 4))
        assert tr.next_step == 7
        found = incidents(tr.stats, IncidentKind.GRADIENT)
        if loss_gate:
            assert tr.stats.host_restores == 0 and device_steps(tr) == [6]  # nothing written
            assert "a loss that was not finite" in str(err.value)
            assert "loss diverged" in str(err.value)
            assert not found and [(i.step, i.action) for i in tr.stats.incidents] == [
                (7, Action.SKIPPED_AND_REPLAYED)] * 3
            assert {i.kind for i in tr.stats.incidents} == {IncidentKind.LOSS}
        else:
            assert tr.stats.host_restores == 3
            assert {i.action for i in found} == {Action.RESTORED_FROM_SNAPSHOT}
    finally:
        tr.close(unlink=True)


def loss_with_a_dead_leaf(params, batch):
    """mlp.loss, and a leaf whose gradient is always 0 (it enters the loss times 0)."""
    live = {k: v for k, v in params.items() if k != "dead"}
    return mlp.loss(live, batch) + 0.0 * jnp.sum(params["dead"].astype(jnp.float32))


def device_steps(tr):
    """The step count the device's state holds (its three copies, every device)."""
    return np.unique(np.asarray(tr.state.opt.step_copies)).tolist()


def dead_leaf_trainer(name, *, eps, devices=1, shard=1, **kw):
    """A Trainer of mlp with a leaf whose gradient is always 0 (300 elements): with eps 0 its
    moments stay 0, so each of its new values is 0 / 0 and the update keeps it, while it
    writes every other leaf -- every step is applied in part."""
    params = {**mlp.init(0), "dead": jnp.zeros((300,), jnp.bfloat16)}
    opt = inplace.adamw(3e-3, eps=eps, master_weights=True, chunk_elems=CHUNK, group=GROUP, **kw)
    tr = Trainer(loss_with_a_dead_leaf, opt, params, mlp.batches(0), shm_name=name,
                 snapshot_every=5, max_skips=3, devices=jax.devices()[:devices], shard=shard)
    tr.prewarm()
    return tr


@pytest.mark.parametrize("devices,shard", [(1, 1), (4, 1), (4, 2)],
                         ids=["1-device", "4-replicas", "fsdp-2x2"])
def test_an_update_that_keeps_elements_is_not_committed(shm_name, devices, shard):
    """The host and the device agree that a step applied in part did not commit: the Trainer
    takes the host snapshot and replays, and after max_skips raises PersistentFault with the
    cause (each kept element counted on every replica that holds it)."""
    needs_devices(devices)
    tr = dead_leaf_trainer(shm_name, eps=0.0, devices=devices, shard=shard)
    try:
        start = tr.current_state()
        with pytest.raises(pimhbm.recovery.PersistentFault,
                           match=r"step 1 was skipped 3 times.* elements whose new values were "
                                 r"not finite.*eps 0") as err:
            tr.run(6, campaign=NoEndlessReplay(1, 4))
        # The dead leaf on every replica, and any other element whose gradient summed to 0
        # exactly (bf16 sums over devices can).
        kept = int(re.search(r"(\d+) elements whose", str(err.value)).group(1))
        assert 300 * (devices // shard) <= kept < 310 * (devices // shard)
        assert tr.stats.host_restores == 3 and tr.next_step == 1 and device_steps(tr) == [0]
        assert same_state(tr.current_state(), start)  # the other leaves' writes taken back
        assert {(i.kind, i.action) for i in tr.stats.incidents} == {
            (IncidentKind.UPDATE, Action.RESTORED_FROM_SNAPSHOT)}
    finally:
        tr.close(unlink=True)


def test_an_update_with_eps_above_0_commits_every_step(shm_name):
    """The control of the test before: the same Trainer with eps 1e-8 commits every step, the
    device's count with the host's."""
    tr = dead_leaf_trainer(shm_name, eps=1e-8)
    try:
        stats = tr.run(6)
        assert stats.steps_committed == 6 and not stats.incidents and device_steps(tr) == [6]
    finally:
        tr.close(unlink=True)


def test_kept_elements_and_a_chunk_left_damaged_go_to_the_host_snapshot(shm_name, rng):
    """A step that kept elements and also left a damaged moment chunk: the chunk's redo could
    not make it whole (the kept elements were never written), so the host snapshot takes both
    back -- the damage recorded as restored, no redo."""
    tr, element = dead_leaf_trainer(shm_name, eps=0.0), int(rng.integers(96 * 96))  # w1's
    try:
        with pytest.raises(pimhbm.recovery.PersistentFault, match="elements whose new values"):
            tr.run(6, campaign=Once(1, lambda t: flip(t, "w1", "nu", element)))
        found = {(i.step, i.kind, i.action) for i in tr.stats.incidents}
        assert (1, IncidentKind.STATE, Action.RESTORED_FROM_SNAPSHOT) in found
        assert not incidents(tr.stats, action=Action.REDONE_FROM_PARITY)
    finally:
        tr.close(unlink=True)


def test_with_the_gradients_checked_in_the_update_kept_elements_name_both_causes(shm_name):
    """There the update counts non-finite gradient values and its own non-finite values
    alike: the error names both, and both hints."""
    tr = dead_leaf_trainer(shm_name, eps=0.0,
                           gradient_checks=inplace.GradientChecks.IN_UPDATE)
    try:
        with pytest.raises(pimhbm.recovery.PersistentFault,
                           match=r"300 non-finite gradient values or new values.*loss "
                                 r"diverged.*eps 0 where a moment is 0"):
            tr.run(6, campaign=NoEndlessReplay(1, 4))
    finally:
        tr.close(unlink=True)


def test_a_learning_rate_that_is_not_finite_runs_nothing_and_says_so(shm_name):
    """A schedule that is NaN from step 3 on: the update runs nothing (no host restore is
    needed), the step is replayed and after max_skips the error names the learning rate, not
    a device."""
    opt = inplace.adamw(lambda count: jnp.where(count >= 3, jnp.nan, 3e-3), master_weights=True,
                        chunk_elems=CHUNK, group=GROUP)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm_name,
                 snapshot_every=5, max_skips=3, devices=jax.devices()[:1])
    try:
        tr.prewarm()
        with pytest.raises(pimhbm.recovery.PersistentFault,
                           match=r"step 3 was skipped 3 times.*a learning rate or bias "
                                 r"correction that could not make finite values.*schedule value"):
            tr.run(6, campaign=NoEndlessReplay(3, 4))
        assert tr.stats.steps_committed == 2 and device_steps(tr) == [2]
        assert tr.stats.host_restores == 0
        assert {(i.step, i.kind, i.action) for i in tr.stats.incidents} == {
            (3, IncidentKind.UPDATE, Action.SKIPPED_AND_REPLAYED)}
    finally:
        tr.close(unlink=True)


@pytest.mark.parametrize("snapshots", ["none", "snapshot-every-0"])
def test_an_update_that_keeps_elements_needs_a_recent_host_snapshot(shm_name, snapshots):
    params = {**mlp.init(0), "dead": jnp.zeros((300,), jnp.bfloat16)}
    opt = inplace.adamw(3e-3, eps=0.0, chunk_elems=CHUNK, group=GROUP)
    kw = dict(shm_name=shm_name, snapshot_every=0) if snapshots != "none" else {}
    tr = Trainer(loss_with_a_dead_leaf, opt, params, mlp.batches(0), devices=jax.devices()[:1],
                 **kw)
    try:
        tr.prewarm()
        with pytest.raises(RuntimeError, match="step 1's update kept 300 elements whose new "
                                               "values were not finite.*pass shm_name=.*eps 0"):
            tr.run(3)
    finally:
        tr.close(unlink=bool(kw))

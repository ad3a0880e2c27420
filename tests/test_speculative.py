"""Speculative parameter checks (pimhbm.inplace.ParameterChecks.IN_UPDATE), on the CPU: no pass
runs before the update's writes. A parameter chunk the update finds damaged may have made the
step's gradients, so that step is applied but does not commit, the chunk's redo does not make
it whole, and the Trainer takes the host snapshot and replays; a damaged moment is still redone
in place. Campaigns of every fault kind end with the fault-free run's state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimhbm import faults, inplace
from pimhbm.campaign import KINDS, Campaign
from pimhbm.recovery import Action, IncidentKind, PersistentFault
from pimhbm.recovery.handling import FaultHandling
from pimhbm.update import FAULT_PARAM
from conftest import needs_devices
from one_copy_trainer import CHUNK, GROUP, Once, fault_free, incidents, make_trainer, same_state
from one_copy_trainer import flip as flip_in_trainer
from test_inplace import KINDS as LAYOUTS
from test_inplace import LR, flip, make, random_grads, random_params, random_spot

W0_ELEMENTS = 32 * 96  # the test model's first weight (pimhbm.models.mlp)
IN_UPDATE = dict(gradient_checks=inplace.GradientChecks.IN_UPDATE,
                 parameter_checks=inplace.ParameterChecks.IN_UPDATE)


def test_parameters_checked_in_the_update_need_the_gradients_checked_there_too():
    with pytest.raises(ValueError, match="gradient_checks=GradientChecks.IN_UPDATE"):
        inplace.adamw(LR, parameter_checks=inplace.ParameterChecks.IN_UPDATE)
    with pytest.raises(TypeError, match="ParameterChecks"):
        inplace.adamw(LR, parameter_checks="in the update")
    assert inplace.adamw(LR, **IN_UPDATE).speculative  # the control: both in the update
    assert not inplace.adamw(LR, gradient_checks=inplace.GradientChecks.IN_UPDATE).speculative


def moments(state):
    return {k: np.asarray(v).copy() for k, v in state.mu.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_damaged_parameter_found_by_a_speculative_update_is_not_committed(rng, layout):
    """A bit of a parameter flipped before the update. Checked before the writes (the control),
    the step writes nothing. Speculatively, the update writes every other chunk, names the
    damaged one, and the step does not commit; the chunk's repair rebuilds and redoes it but
    is not complete (the step's gradients may have read the damage)."""
    leaf, index, bit = "t0", int(rng.integers(300 * 77)), int(rng.integers(16))
    for kw in ({}, IN_UPDATE):
        opt, dtype = make(layout, **kw)
        params = random_params(rng, dtype)
        update, repair = (jax.jit(opt.update, donate_argnums=1),
                          jax.jit(opt.repair, donate_argnums=0))
        state = flip(opt.init(params), "p", leaf, index, bit)
        before = moments(state)
        state, report = update(random_grads(rng, params), state)
        after = moments(state)
        assert not bool(report.committed) and int(report.digest_faults) == 1, kw
        assert int(report.suspect) == (1 if kw else 0), kw  # the update's own count
        if not kw:
            assert not bool(report.applied)
            assert all(after[k].tobytes() == before[k].tobytes() for k in before)
            continue
        assert bool(report.applied) and int(report.kept) == 0
        faults = np.asarray(report.fault_maps[leaf])
        chunk = index // opt.chunk_elems
        assert faults[chunk] & FAULT_PARAM and np.count_nonzero(faults) == 1
        assert all((after[k] != before[k]).mean() > 0.5 for k in before)  # the others written
        assert (after[leaf].reshape(-1)[chunk * opt.chunk_elems:][:opt.chunk_elems] ==
                before[leaf].reshape(-1)[chunk * opt.chunk_elems:][:opt.chunk_elems]).all()
        state, fixed = repair(state, report)
        assert not bool(fixed.complete) and int(fixed.faults) == 0


def test_a_damaged_moment_found_by_a_speculative_update_is_still_redone_in_place(rng):
    """The moments do not reach the gradients: their damage found by the update leaves the
    chunk for its redo, and the step commits and is whole after it (as by default)."""
    opt, dtype = make("bf16_master", **IN_UPDATE)
    params = random_params(rng, dtype)
    leaf, at, _ = random_spot(rng, params, opt.chunk_elems)
    state = flip(opt.init(params), "mu", leaf, at, int(rng.integers(32)))
    state, report = jax.jit(opt.update, donate_argnums=1)(random_grads(rng, params), state)
    assert bool(report.committed) and int(report.digest_faults) == 1
    assert int(report.suspect) == 0
    state, fixed = jax.jit(opt.repair, donate_argnums=0)(state, report)
    assert bool(fixed.complete)


@pytest.mark.parametrize("third", ["parameter", "moment"])
def test_a_parameter_beyond_the_fault_list_is_known_by_the_devices_count(shm_name, third,
                                                                        monkeypatch):
    """Three chunks damaged before one step, the fault list holding two: two moments (listed
    first: lower chunk indices) and a third chunk that is a parameter or (the control) another
    moment. The update's own count of damaged parameter chunks tells them apart where the list
    cannot: the parameter sends the step to the host snapshot at once, no redo tried; three
    moments are redone from parity with no restore. Both end bit-identical."""
    redos = []
    redo = FaultHandling._redo
    monkeypatch.setattr(FaultHandling, "_redo", lambda self: redos.append(1) or redo(self))
    steps, at = 12, 5
    reference = fault_free(shm_name, steps)
    last = ("w1", "p", 3 * CHUNK + 1) if third == "parameter" else ("w1", "mu", 3 * CHUNK + 1)

    def inject(t):
        flip_in_trainer(t, "w0", "mu", 1 * CHUNK + 2)
        flip_in_trainer(t, "w0", "nu", 2 * CHUNK + 5)
        flip_in_trainer(t, *last, bit=9)

    tr = make_trainer(shm_name, **IN_UPDATE, fault_capacity=2)
    try:
        stats = tr.run(steps, campaign=Once(at, inject))
        found = incidents(stats, IncidentKind.STATE)
        assert found and found[0].step == at
        if third == "parameter":
            assert {i.action for i in found} == {Action.RESTORED_FROM_SNAPSHOT}
            assert stats.host_restores == 1 and not redos
        else:
            assert [i.action for i in found] == [Action.REDONE_FROM_PARITY]
            assert stats.host_restores == 0 and redos
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def flips_of_parameters(name, steps, devices=1, group=GROUP):
    """A run with two parameter flips before their steps: its stats and whether it ended with
    the fault-free run's state."""
    reference = fault_free(name, steps, devices=devices, shard=1, group=group)
    tr = make_trainer(name, inject=True, **IN_UPDATE, devices=devices, shard=1, group=group)
    try:
        campaign = Campaign(tr, {"param_flip": 2}, last_step=steps - 2, seed=5)
        stats = tr.run(steps, campaign=campaign)
        assert campaign.check(stats)["param_flip"]["missed"] == 0
        return stats, same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def test_each_damaged_parameter_sends_its_step_to_the_host_snapshot(shm_name, monkeypatch):
    """Parameter flips alone, before their steps: each step's update finds its chunk, the step
    does not commit and comes back from the host snapshot, and the run ends bit-identical. The
    control: with the verdicts taken out (the update's, the redo's and the loop's), both chunks
    are redone from parity, and the steps' gradients, which read the flipped bits, take the run
    elsewhere."""
    stats, same = flips_of_parameters(shm_name, 24)
    state = incidents(stats, IncidentKind.STATE)
    assert len(state) == 2 and {i.action for i in state} == {Action.RESTORED_FROM_SNAPSHOT}
    assert stats.host_restores == 2 and same

    monkeypatch.setattr(inplace.AdamW, "_suspect", lambda self, totals: jnp.int32(0))
    monkeypatch.setattr(inplace.AdamW, "_suspect_left", lambda self, index: jnp.bool_(False))
    monkeypatch.setattr(FaultHandling, "_suspect", lambda self, report: False)
    stats, same = flips_of_parameters(shm_name + "_control", 24)
    assert {i.action for i in incidents(stats, IncidentKind.STATE)} == {
        Action.REDONE_FROM_PARITY}
    assert stats.host_restores == 0 and not same


def test_with_replicas_alone_a_damaged_parameter_still_goes_to_the_host_snapshot(
        shm_name, monkeypatch):
    """Four replicas, no parity: every replica's update applied the gradients summed over the
    replicas, so a healthy replica's chunk would not make the step whole either -- the loop
    sends it to the host snapshot. The control: with the loop's verdict alone taken out, the
    chunk is pulled from a replica, the step commits, and the run ends elsewhere."""
    needs_devices(4)
    stats, same = flips_of_parameters(shm_name, 24, devices=4, group=0)
    assert {i.action for i in incidents(stats, IncidentKind.STATE)} == {
        Action.RESTORED_FROM_SNAPSHOT}
    assert stats.host_restores == 2 and same

    monkeypatch.setattr(FaultHandling, "_suspect", lambda self, report: False)
    stats, same = flips_of_parameters(shm_name + "_control", 24, devices=4, group=0)
    assert stats.host_restores == 0 and not same


@pytest.mark.parametrize("devices,shard,scrub", [(1, 1, True), (4, 2, True), (1, 1, False)],
                         ids=["1-device", "fsdp-2x2", "control-no-scrub"])
def test_a_parameter_that_makes_the_loss_nan_is_found_by_a_scrub_and_rebuilt(
        shm_name, monkeypatch, rng, devices, shard, scrub):
    """A NaN written into a parameter before step 5: the loss is NaN and holds the step before
    any write, and no check has read the parameters -- the Trainer scrubs the state, rebuilds
    the chunk from its parity and replays: no host restore, bit-identical. The control, without
    that scrub: nothing finds the NaN, and every replay's loss holds the step again until the
    run stops with an error that names the loss. (FSDP 2 x 2: on device 0's shard alone, at any
    of its elements.)"""
    needs_devices(devices)
    if not scrub:
        monkeypatch.setattr(FaultHandling, "_with_scrubbed_state", lambda self, report: report)
    steps, kw = 12, dict(devices=devices, shard=shard)
    reference = fault_free(shm_name, steps, **kw)
    tr = make_trainer(shm_name, **IN_UPDATE, **kw)
    element = int(rng.integers(W0_ELEMENTS // shard))  # a place on device 0's shard of w0
    device = 0 if devices > 1 else None
    try:
        campaign = Once(5, lambda t: t.inject("w0", "p", faults.spec(
            faults.NONFINITE, offset=element, value="nan"), device=device))
        if not scrub:
            with pytest.raises(PersistentFault, match="step 5 was skipped .*a loss that was not "
                                                      "finite"):
                tr.run(steps, campaign=campaign)
            return
        stats = tr.run(steps, campaign=campaign)
        found = incidents(stats, IncidentKind.STATE)
        assert [(i.step, i.action) for i in found] == [(5, Action.REPAIRED_FROM_PARITY)]
        assert [(l.device, l.leaf, l.tensor, l.chunk) for l in found[0].locations] == [
            (0, "w0", "p", element // CHUNK)]
        assert stats.host_restores == 0 and stats.compiles_after_prewarm == 0
        assert not incidents(stats, IncidentKind.GRADIENT) and not incidents(
            stats, IncidentKind.LOSS)  # the damage found explains the loss
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def test_a_scrub_that_lists_too_little_sends_the_step_to_another_source(shm_name, rng):
    """The same NaN parameter, with a fault list of one entry: the scrub marks the damaged
    chunk and its parity group's (their row no longer matches), more than it lists, so the
    repair does not trust the list -- on one device the host snapshot takes the state back --
    and the run ends bit-identical, where the list alone could miss the chunk and replay the
    NaN loss for ever."""
    steps = 12
    reference = fault_free(shm_name, steps)
    tr = make_trainer(shm_name, **IN_UPDATE, fault_capacity=1)
    try:
        stats = tr.run(steps, campaign=Once(5, lambda t: t.inject("w0", "p", faults.spec(
            faults.NONFINITE, offset=int(rng.integers(W0_ELEMENTS)), value="nan"))))
        assert stats.host_restores == 1 and stats.compiles_after_prewarm == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


@pytest.mark.parametrize("devices,shard", [(1, 1), (4, 2)], ids=["1-device", "fsdp-2x2"])
def test_a_speculative_campaign_of_every_kind_ends_bit_identical(shm_name, devices, shard):
    """Every fault kind, no checks before the writes: a damaged parameter chunk sends its step
    to the host snapshot (restored, replayed), a damaged moment or master weight is redone from
    parity, and the run ends with the fault-free run's state (run with the checks before the
    writes: the same arithmetic), with 0 compilations after prewarm."""
    needs_devices(devices)
    steps = 24
    kw = dict(devices=devices, shard=shard, group=GROUP)
    reference = fault_free(shm_name, steps, **kw)
    tr = make_trainer(shm_name, inject=True, **IN_UPDATE, **kw)
    try:
        campaign = Campaign(tr, {k: 2 for k in KINDS}, last_step=steps - 2, seed=5)
        stats = tr.run(steps, campaign=campaign)
        found = campaign.check(stats)
        assert all(r["missed"] == 0 and r["repaired"] == r["injected"]
                   for r in found.values()), found
        assert stats.compiles_after_prewarm == 0
        assert same_state(tr.current_state(), reference)
        restored = incidents(stats, IncidentKind.STATE, Action.RESTORED_FROM_SNAPSHOT)
        assert any(loc.tensor == "p" for i in restored for loc in i.locations)
        assert incidents(stats, IncidentKind.STATE, Action.REDONE_FROM_PARITY)
    finally:
        tr.close(unlink=True)


def test_the_counts_a_speculative_fence_sees_wait_for_every_gradient(rng):
    """No checks run, yet the counts the update's verdict is drawn from (the Trainer puts the
    snapshot fence on them, ``before_writes``) come out of a barrier that holds every gradient:
    drawn from a constant instead, the fence could run before the backward pass and stall it on
    a snapshot's copy. The control: by default no such barrier (the counts are the checks
    call's, which reads every gradient)."""
    for kw in ({}, IN_UPDATE):
        opt, dtype = make("bf16_master", **kw)
        params = random_params(rng, dtype)
        grads, state = random_grads(rng, params), opt.init(params)
        jaxpr = jax.make_jaxpr(lambda g, s: opt.update(g, s, before_writes=lambda c: c + 0))(
            grads, state).jaxpr
        gradients = set(jaxpr.invars[:len(params)])
        barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                    and gradients <= set(e.invars)]
        assert len(barriers) == (1 if kw else 0), kw
        if kw:
            counts = barriers[0].outvars[0]
            assert counts.aval.shape == (2,)
            fence = [e for e in jaxpr.eqns if e.primitive.name == "add" and counts in e.invars]
            assert len(fence) == 1  # before_writes got the barrier's counts


def variables(eqn):
    """An equation's operands that are variables (not literals)."""
    return {v for v in eqn.invars if type(v).__name__ != "Literal"}


def test_the_parameter_checks_alone_run_after_every_gradient(rng):
    """With the gradients checked in the update, the pass before the writes reads p alone; its
    parameters come out of a barrier that holds every gradient, so that the checks follow the
    backward pass's last read of p (else XLA, which orders by data only, may run them first,
    and damage between them and that read would reach the gradients unseen). The control: the
    default's pass reads the gradients themselves, and needs no barrier. (The traced program:
    on the CPU, XLA drops barriers before it schedules; on the GPU after.)"""
    for checks, barrier in ((inplace.GradientChecks.BEFORE_WRITES, False),
                            (inplace.GradientChecks.IN_UPDATE, True)):
        opt, dtype = make("bf16_master", gradient_checks=checks)
        params = random_params(rng, dtype)
        grads, state = random_grads(rng, params), opt.init(params)
        jaxpr = jax.make_jaxpr(opt.update)(grads, state).jaxpr
        gradients = set(jaxpr.invars[:len(params)])
        barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"
                    and gradients <= set(e.invars)]
        assert len(barriers) == int(barrier), checks
        if barrier:
            passed = set(barriers[0].outvars[:len(params)])  # the parameters, through it
            readers = [e for e in jaxpr.eqns if passed & variables(e)]
            assert readers and passed <= variables(readers[0])  # the checks read them all

"""Faults that stay finite: a chunk changed together with its digest (as a wrong computation
leaves it) matches its own digest, so only another replica can tell. The step compares the
replicas' digests; a replica that disagrees with the majority is repaired from it."""


import jax
import pytest

import pimhbm
from pimhbm import faults
from pimhbm.models import mlp
from pimhbm.recovery import Action, IncidentKind, Trainer

STEPS = 20


def make_trainer(name, devices):
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                 scrub_every=5, telemetry=None, devices=jax.devices()[:devices])
    tr.prewarm()
    return tr


class WrongValue:
    """At step 12, one element of w1's parameters on ``device`` changed in the state and in its
    device copy, each with its digests made anew."""

    def __init__(self, rng, device):
        self.device, self.offset = device, 2 * int(rng.integers(0, 96 * 96))
        self.bit = int(rng.integers(0, 16))

    def before_step(self, trainer, step, attempt):
        if step == 12 and attempt == 1:
            fault = faults.spec(faults.FLIP_BIT, offset=self.offset + self.bit // 8,
                                bit=self.bit % 8)
            for copy in (False, True):
                trainer.inject("w1", "p", fault, into_copy=copy, device=self.device, rehash=True)
        return None

    def before_scrub(self, trainer, step):
        pass


def run_pair(shm_name, devices, rng, device):
    ref = make_trainer(shm_name + "_ref", devices)
    ref.run(STEPS)
    want = ref.current_state()
    ref.close()
    tr = make_trainer(shm_name, devices)
    fault = WrongValue(rng, device)
    stats = tr.run(STEPS, campaign=fault)
    got = tr.current_state()
    tr.close()
    same = all(want[k].tobytes() == got[k].tobytes() for k in want)
    return stats, fault, same, tr.compiles


def test_a_replica_that_disagrees_is_repaired_from_the_majority(shm_name, rng):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    stats, fault, same, compiles = run_pair(shm_name, 4, rng, device=2)
    found = [i for i in stats.incidents if i.kind is IncidentKind.DISAGREEMENT]
    assert found and found[0].step == 12
    chunk = fault.offset // 2 // 256
    assert set(found[0].locations) == {(d, "w1", "p", chunk) for d in range(4)}
    assert found[0].action is Action.REPAIRED_FROM_REPLICA and found[0].sources == (0,)
    assert not [i for i in stats.incidents if i.kind is IncidentKind.STATE]  # digests matched
    assert stats.host_restores == 0 and stats.replica_repairs == 1 and compiles == 0
    assert same, "the run did not end bit-identical"


def test_two_replicas_that_disagree_go_to_the_host_snapshot(shm_name, rng):
    """Neither of two replicas can be told right: the state comes from the host snapshot, and
    the replay ends bit-identical."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    stats, _, same, compiles = run_pair(shm_name, 2, rng, device=1)
    found = [i for i in stats.incidents if i.kind is IncidentKind.DISAGREEMENT]
    assert found and found[0].action is Action.RESTORED_FROM_SNAPSHOT
    assert found[0].snapshot_step == 10 and stats.host_restores == 1 and compiles == 0
    assert same


def test_on_one_device_the_same_fault_goes_unseen(shm_name, rng):
    """The control: without another replica the changed chunk matches its digest, nothing is
    reported, and the run ends in another state."""
    stats, _, same, _ = run_pair(shm_name, 1, rng, device=0)
    assert stats.incidents == [] and not same

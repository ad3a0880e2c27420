"""The recovery engine on one copy of the state (pimhbm.inplace), on the CPU: the campaign of
every fault kind on 1 device (parity), 4 data-parallel devices (the replicas are the redundancy)
and FSDP over 2 x 2 (parity of each shard) -- every fault found, located and repaired, the run
bit-identical to the one without faults, nothing compiled after prewarm -- and the paths of one
copy: a redo, two chunks of one group, a stale parity row, a resume from the host snapshot."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pimhbm import faults, inplace, parity
from pimhbm.campaign import KINDS, Campaign
from pimhbm.models import mlp
from pimhbm.recovery import Action, DeviceFailure, IncidentKind, Trainer
from pimhbm.recovery.placement import AXES
from conftest import needs_devices
from one_copy_trainer import (CHUNK, GROUP, Once, fault_free, flip, incidents, make_trainer,
                              same_state)


@pytest.mark.parametrize("devices,shard,group", [(1, 1, GROUP), (4, 1, 0), (4, 2, GROUP)],
                         ids=["1-device-parity", "4-replicas", "fsdp-2x2-parity"])
def test_a_campaign_of_every_kind_ends_bit_identical(shm_name, devices, shard, group):
    needs_devices(devices)
    steps = 24
    kw = dict(devices=devices, shard=shard, group=group)
    reference = fault_free(shm_name, steps, **kw)
    tr = make_trainer(shm_name, inject=True, **kw)
    try:
        assert tr.one_copy and tr.local_source == (group > 0)
        campaign = Campaign(tr, {k: 2 for k in KINDS}, last_step=steps - 2, seed=3)
        stats = tr.run(steps, campaign=campaign)
        found = campaign.check(stats)
        assert all(r["missed"] == 0 and r["repaired"] == r["injected"] for r in found.values()), found
        assert sum(r["detected"] for r in found.values()) >= len(campaign.plan) - 2, found
        assert stats.compiles_after_prewarm == 0
        assert same_state(tr.current_state(), reference)
        if group:  # the update's own finds: rebuilt from parity and redone, no replay of it
            assert incidents(stats, IncidentKind.STATE, Action.REDONE_FROM_PARITY)
        else:
            assert incidents(stats, IncidentKind.STATE, Action.REPAIRED_FROM_REPLICA)
    finally:
        tr.close(unlink=True)


@pytest.mark.parametrize("in_flight", [2, 3])
def test_a_moment_found_by_the_update_is_redone_in_place_without_a_replay(shm_name, in_flight):
    reference = fault_free(shm_name, 12)
    tr = make_trainer(shm_name, in_flight=in_flight)
    try:
        stats = tr.run(12, campaign=Once(7, lambda t: flip(t, "w1", "nu", 5 * CHUNK + 9)))
        redone = incidents(stats, IncidentKind.STATE)
        assert [(i.step, i.action) for i in redone] == [(7, Action.REDONE_FROM_PARITY)]
        assert [(l.leaf, l.tensor, l.chunk) for l in redone[0].locations] == [("w1", "nu", 5)]
        # Step 7 was applied once and completed by the redo: only the steps halted behind it
        # (in flight when its summary was read) ran again.
        assert stats.steps_replayed == in_flight - 1 and stats.host_restores == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def test_a_parameter_damaged_before_the_step_cancels_it_and_is_rebuilt(shm_name):
    reference = fault_free(shm_name, 12)
    tr = make_trainer(shm_name)
    try:
        stats = tr.run(12, campaign=Once(5, lambda t: flip(t, "w0", "p", 3 * CHUNK + 1, bit=9)))
        found = incidents(stats, IncidentKind.STATE)
        assert found and found[0].step == 5 and found[0].action is Action.REPAIRED_FROM_PARITY
        assert stats.host_restores == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


class Stream:
    """A data source that hands out its batches in order, whatever step is asked for (an
    iterator): asking twice for a step would train on the next batch instead."""

    def __init__(self):
        self.make, self.handed, self.asked = mlp.batches(0), 0, []

    def __call__(self, step):
        self.asked.append(step)
        self.handed += 1
        return self.make(self.handed)


def test_replays_use_the_logged_batch_and_never_ask_the_data_source_twice():
    """Without the shared-memory region the batches are logged in memory: a step cancelled by a
    damaged parameter and the steps halted behind it run again on the batches they first had."""
    def run(inject):
        stream = Stream()
        opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
        tr = Trainer(mlp.loss, opt, mlp.init(0), stream, shm_name=None, scrub_every=5,
                     in_flight=3)
        tr.prewarm()
        try:
            return tr.run(12, campaign=Once(5, inject) if inject else None), stream, \
                tr.current_state()
        finally:
            tr.close()

    _, clean_stream, reference = run(None)
    stats, stream, state = run(lambda t: flip(t, "w0", "p", 3 * CHUNK + 1, bit=9))
    assert stats.steps_replayed > 0  # the control: steps did run again
    assert clean_stream.asked == stream.asked == list(range(1, 13))
    assert same_state(state, reference)


def dropout_loss(params, batch, key):
    """mlp.loss on a nested batch, with dropout of the inputs drawn from the step's key."""
    x, y = batch["inputs"][0], batch["labels"]
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return mlp.loss(params, {"x": jnp.where(keep, x / 0.8, 0.0), "y": y})


def nested_batches(step):
    flat = mlp.batches(0)(step)
    return {"inputs": (flat["x"],), "labels": flat["y"]}


def run_with_key(rng, inject=None, devices=1, loss=dropout_loss, **kw):
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK,
                        group=GROUP if devices == 1 else 0)
    tr = Trainer(loss, opt, mlp.init(0), nested_batches, scrub_every=5, rng=rng,
                 devices=jax.devices()[:devices], **kw)
    tr.prewarm()
    try:
        stats = tr.run(12, campaign=Once(5, inject) if inject else None)
        return stats, tr.current_state()
    finally:
        tr.close()


def test_a_nested_batch_and_a_key_per_step_replay_bit_identically():
    _, reference = run_with_key(jax.random.key(7))
    stats, state = run_with_key(jax.random.key(7),
                                lambda t: flip(t, "w0", "p", 3 * CHUNK + 1, bit=9))
    assert stats.steps_replayed > 0 and same_state(state, reference)
    # The key is used: another key trains otherwise.
    _, other = run_with_key(jax.random.key(8))
    assert not same_state(other, reference)


def test_each_device_slice_gets_its_own_key_and_the_re_execution_agrees():
    """4 replicas, every step re-executed by the next device on this device's slice: the slice
    carries its key's (step, device), so the re-execution draws the same dropout."""
    needs_devices(4)
    stats, _ = run_with_key(jax.random.key(7), devices=4, recheck_every=1)
    assert stats.steps_committed == 12 and not stats.incidents
    # The control: a key that depends on the device computing it (not on the slice) makes the
    # re-execution disagree -- so the run above did compare dropouts.
    own = lambda params, batch, key: dropout_loss(
        params, batch, jax.random.fold_in(key, jax.lax.axis_index(AXES)))
    try:
        stats, _ = run_with_key(jax.random.key(7), devices=4, recheck_every=1, loss=own)
        assert incidents(stats, IncidentKind.COMPUTE)
    except DeviceFailure:
        pass


def dispatched_in_cpp(compiled) -> bool:
    """Whether JAX calls ``compiled`` through its C++ dispatch (a program holding an op with a
    side effect takes the Python path: milliseconds a call for a step's hundreds of arrays)."""
    return compiled._executable.create_cpp_call(compiled._params) is not None


def test_the_step_is_dispatched_by_jaxs_cpp_path(shm_name):
    tr = make_trainer(shm_name)
    try:
        assert dispatched_in_cpp(tr.programs.step[0])
        # The control: the snapshot program copies to the host (a side effect).
        assert not any(dispatched_in_cpp(p) for p in tr.programs.snapshot.values())
    finally:
        tr.close(unlink=True)


def test_the_host_waits_for_no_snapshot_between_steps(shm_name, monkeypatch):
    tr = make_trainer(shm_name)  # a snapshot every 10 steps
    waits = []
    wait = tr.snapshots._wait
    monkeypatch.setattr(tr.snapshots, "_wait", lambda: waits.append(tr.next_step) or wait())
    try:
        stats = tr.run(35)
        # Waited for: the starting state's snapshot (nothing runs beside it) and the run's end.
        # Those of steps 10, 20 and 30 were sealed once the step after them had committed.
        assert waits == [1, 36]
        assert stats.snapshots == 4 and not stats.incidents
        assert [step for step, _ in tr.backup.newest()] == [30, 20]
        assert all(tr.backup.verified(slot) for _, slot in tr.backup.newest())
    finally:
        tr.close(unlink=True)


def w1_groups(tr):
    """The parity group of each chunk of the mlp's w1."""
    n = next(n for p, t, n, _ in tr.tensor_info() if p == "w1" and t == "mu")
    return parity.chunk_groups(-(-n // CHUNK), GROUP)


def test_two_damaged_chunks_of_one_group_go_to_the_host_snapshot(shm_name):
    reference = fault_free(shm_name, 14)
    tr = make_trainer(shm_name)
    groups = w1_groups(tr)
    members = np.flatnonzero(groups == groups[GROUP])
    partner = int(members[members > GROUP][0])  # the next chunk of chunk GROUP's group
    assert partner > GROUP + 1

    def two(t):
        flip(t, "w1", "mu", GROUP * CHUNK + 3)
        flip(t, "w1", "mu", partner * CHUNK + 70)
    try:
        stats = tr.run(14, campaign=Once(12, two))
        found = incidents(stats, IncidentKind.STATE)
        assert [(i.step, i.action) for i in found] == [(12, Action.RESTORED_FROM_SNAPSHOT)]
        assert {(l.tensor, l.chunk) for l in found[0].locations} >= {("mu", GROUP),
                                                                      ("mu", partner)}
        assert stats.host_restores == 1
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


@pytest.mark.parametrize("tensor", ["mu", "p"])
def test_a_burst_over_neighbouring_chunks_is_rebuilt_in_place(shm_name, tensor):
    """Two chunks' bytes overwritten across three neighbouring chunks (a failed row): each sits
    in a group of its own, so each is rebuilt from its parity -- no host snapshot,
    bit-identical."""
    reference = fault_free(shm_name, 14)
    tr = make_trainer(shm_name)
    size = next(s for p, t, _, s in tr.tensor_info() if p == "w1" and t == tensor)
    first, length = GROUP * CHUNK * size + 100, 2 * CHUNK * size
    chunks = set(range(first // (CHUNK * size), (first + length - 1) // (CHUNK * size) + 1))
    assert len(chunks) == 3 and len({int(w1_groups(tr)[c]) for c in chunks}) == 3
    burst = lambda t: t.inject("w1", tensor, faults.spec(faults.OVERWRITE, offset=first,
                                                         length=length, seed=11))
    try:
        stats = tr.run(14, campaign=Once(12, burst))
        found = incidents(stats, IncidentKind.STATE)
        assert found and {i.action for i in found} <= {Action.REDONE_FROM_PARITY,
                                                        Action.REPAIRED_FROM_PARITY}, found
        assert {l.chunk for i in found for l in i.locations if l.tensor == tensor} == chunks
        assert stats.host_restores == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def damage_row(tr, path, tensor, row, word, bit):
    """One bit of a parity row flipped in the Trainer's state."""
    i = tr.layout.leaf_index(path)
    rows = tr.traced.treedef.flatten_up_to(tr.state.opt.parity)
    rows[i][tensor] = rows[i][tensor].at[row, word].set(
        rows[i][tensor][row, word] ^ jnp.uint32(1 << bit))
    opt = tr.state.opt._replace(parity=jax.tree.unflatten(tr.traced.treedef, rows))
    tr.state = tr.state._replace(opt=opt)


def row_is_fresh(tr, path, tensor):
    i = tr.layout.leaf_index(path)
    x = tr.traced.tensors(tr.state.opt)[i][tensor][0]
    fresh = parity.parity(x, tr.layout.chunk_bytes(tensor, i), GROUP)
    now = tr.traced.treedef.flatten_up_to(tr.state.opt.parity)[i][tensor]
    return np.array_equal(np.asarray(now), np.asarray(fresh))


def test_the_next_update_writes_a_damaged_parity_row_anew(shm_name):
    """A parity row is read by no step, but each committing update writes it anew from its
    group: damaged between steps, it is whole again one step later, with nothing to report."""
    reference = fault_free(shm_name, 8)
    tr = make_trainer(shm_name)
    try:
        tr.run(3)
        damage_row(tr, "w1", "nu", 1, 5, 20)
        assert not row_is_fresh(tr, "w1", "nu")  # the control: the damage is there
        stats = tr.run(4)  # no scrub is due: the update of step 4 alone
        assert row_is_fresh(tr, "w1", "nu")
        assert not stats.incidents
        tr.run(8)
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def test_one_copy_schedules_no_scrubs_unless_asked():
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), devices=jax.devices()[:1],
                 telemetry=None)
    try:
        assert tr.scrub_every == 0
        tr.prewarm()
        assert tr.run(6).scrubs == 0
    finally:
        tr.close()
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), devices=jax.devices()[:1],
                 telemetry=None, scrub_every=3)
    try:
        tr.prewarm()
        assert tr.run(6).scrubs == 2  # the control: asked for, they run
    finally:
        tr.close()


def test_a_scrub_finds_a_stale_parity_row_and_makes_it_anew(shm_name):
    """Damage to a row after the step that would have written it anew: the scrub (asked for
    every 5 steps) finds it and makes it from the chunks."""

    class AfterTheUpdate:
        def before_step(self, trainer, step, attempt):
            return None

        def before_scrub(self, trainer, step):
            if step == 5:
                damage_row(trainer, "w1", "nu", 1, 5, 20)

    tr = make_trainer(shm_name)
    try:
        stats = tr.run(5, campaign=AfterTheUpdate())
        remade = incidents(stats, IncidentKind.PARITY)
        assert [(i.step, i.action) for i in remade] == [(5, Action.PARITY_REMADE)]
        assert {l.chunk for l in remade[0].locations} == set(np.flatnonzero(w1_groups(tr) == 1))
        assert row_is_fresh(tr, "w1", "nu")
    finally:
        tr.close(unlink=True)


def test_a_run_resumes_from_its_host_snapshot(shm_name):
    reference = fault_free(shm_name, 16)
    tr = make_trainer(shm_name)
    tr.run(13)  # the snapshot of step 10 is the newest complete one
    tr.close()
    again = make_trainer(shm_name, resume=True)
    try:
        assert again.next_step == 11
        again.run(16)
        assert same_state(again.current_state(), reference)
    finally:
        again.close(unlink=True)


def test_one_copy_refuses_a_device_copy_fault_and_runs_without_parity_only_with_replicas(
        shm_name):
    with pytest.raises(ValueError, match="group=0"):
        make_trainer(shm_name, group=0)
    with pytest.raises(ValueError, match="in flight"):
        make_trainer(shm_name, in_flight=0)
    tr = make_trainer(shm_name)
    try:
        with pytest.raises(ValueError, match="no device copy"):
            tr.inject("w0", "p", faults.spec(faults.FLIP_BIT, offset=0, bit=0), into_copy=True)
    finally:
        tr.close(unlink=True)


def test_the_protected_state_is_no_larger_than_optaxs():
    """Every array the Trainer holds between steps (llama_trainer's defaults: one copy, parity,
    bf16 parameters with fp32 master weights), against optax's state for the same model:
    bf16 parameters, fp32 master weights, mu and nu (14 bytes a parameter)."""
    from pimhbm.models import llama3
    from pimhbm.train import llama_trainer
    cfg = llama3.tiny()
    tr = llama_trainer(cfg, bytes(range(256)) * 64, steps=10, devices=jax.devices()[:1])
    try:
        assert tr.one_copy and tr.local_source
        held = sum(x.nbytes for x in jax.tree.leaves(tr.state))
        params = jax.tree.leaves(tr.state.opt.params)
        n = sum(p.size for p in params)
        optax_bytes = 14 * n
        ratio = held / optax_bytes
        print(f"held {held / n:.2f} B a parameter over {n} parameters: {ratio:.3f}x optax")
        assert ratio <= 1.10
        # The positive control: the two-slot state of the same model is far above it.
        two = llama_trainer(cfg, bytes(range(256)) * 64, steps=10, devices=jax.devices()[:1],
                            state="two-slots")
        try:
            assert sum(x.nbytes for x in jax.tree.leaves(two.state)) / optax_bytes > 2
        finally:
            two.close()
    finally:
        tr.close()


def test_the_trainer_checks_gradients_in_the_update_where_snapshots_back_it(shm_name):
    """llama_trainer's default: one copy backed by host snapshots finds non-finite gradients in
    the update (the pass before the writes reads p alone); without snapshots, or with two
    slots, before the writes; an explicit choice is kept. The state it holds is the same
    either way (the memory test above runs without snapshots)."""
    from pimhbm.models import llama3
    from pimhbm.train import llama_trainer
    text, cfg = bytes(range(256)) * 64, llama3.tiny()
    make = lambda **kw: llama_trainer(cfg, text, steps=10, devices=jax.devices()[:1], **kw)
    made = {"snapshots": make(shm_name=shm_name), "none": make(),
            "no interval": make(shm_name=shm_name + "_0", snapshot_every=0),
            "two slots": make(shm_name=shm_name + "_2", state="two-slots"),
            "asked": make(shm_name=shm_name + "_b",
                          gradient_checks=inplace.GradientChecks.BEFORE_WRITES)}
    try:
        where = {k: getattr(t.opt, "gradient_checks", None) for k, t in made.items()}
        assert where == {"snapshots": inplace.GradientChecks.IN_UPDATE,
                         "none": inplace.GradientChecks.BEFORE_WRITES,
                         "no interval": inplace.GradientChecks.BEFORE_WRITES,
                         "two slots": None, "asked": inplace.GradientChecks.BEFORE_WRITES}
        held = lambda t: sum(x.nbytes for x in jax.tree.leaves(t.state))
        assert held(made["snapshots"]) == held(made["none"])
    finally:
        for t in made.values():
            t.close(unlink=True)


def test_a_row_stale_from_a_damaged_chunk_is_kept_and_rebuilds_it(shm_name):
    """Damage landing just before a scrub makes its group's parity row look stale; remade from
    the state, the row would carry the damage into the rebuild. It is kept (a chunk of its group
    fails its digest), and the next step's redo rebuilds the chunk from it."""
    reference = fault_free(shm_name, 8)

    class BeforeTheScrub:
        def before_step(self, trainer, step, attempt):
            return None

        def before_scrub(self, trainer, step):
            if step == 5:
                flip(trainer, "w1", "mu", 5 * CHUNK + 17)

    tr = make_trainer(shm_name)
    try:
        stats = tr.run(8, campaign=BeforeTheScrub())
        kept = incidents(stats, IncidentKind.PARITY)
        assert [(i.step, i.action) for i in kept] == [(5, Action.PARITY_KEPT)]
        redone = incidents(stats, IncidentKind.STATE)
        assert [(i.step, i.action) for i in redone] == [(6, Action.REDONE_FROM_PARITY)]
        assert stats.host_restores == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


class GradientFlip:
    """The sign of one bf16 gradient value of w1 flipped at ``step`` (first attempt only): a
    finite wrong value no digest can see -- on ``device``'s own gradients before the reduction,
    or (``device`` None) after it, on every device."""

    def __init__(self, rng, step, device):
        self.step, self.device = step, device
        self.element = int(rng.integers(0, 96 * 96))

    def before_step(self, trainer, step, attempt):
        if step != self.step or attempt != 1:
            return None
        spec = faults.spec(faults.FLIP_BIT, offset=2 * self.element + 1, bit=7)
        return faults.GradientFault(trainer.paths.index("w1"), spec, self.device)

    def before_scrub(self, trainer, step):
        pass


@pytest.mark.parametrize("step,sampled", [(10, True), (12, False)], ids=["sampled", "control"])
def test_a_sampled_steps_re_execution_closes_its_gate_before_any_write(shm_name, rng, step,
                                                                        sampled):
    """One copy cannot undo a step: a sampled step computes each device's slice again on the
    next device before its update, and gradients that differ close the gate -- nothing is
    written, the step is replayed. The control: a flip on a step that is not sampled goes
    unseen, and the run ends elsewhere. It flips the reduced gradient: one device's part can be
    small enough that the bf16 sum over devices rounds its flip away (a CI run ended so), while
    the sampled step compares that device's part bit for bit."""
    needs_devices(4)
    kw = dict(devices=4, recheck_every=5)
    reference = fault_free(shm_name, 14, **kw)
    tr = make_trainer(shm_name, inject=True, **kw)
    try:
        stats = tr.run(14, campaign=GradientFlip(rng, step, device=2 if sampled else None))
        found = [(i.step, i.devices, i.action) for i in incidents(stats, IncidentKind.COMPUTE)]
        if sampled:
            assert found == [(10, (2,), Action.SKIPPED_AND_REPLAYED)]
            assert [i.kind for i in stats.incidents] == [IncidentKind.COMPUTE]
            assert same_state(tr.current_state(), reference)
        else:
            assert stats.incidents == [] and not same_state(tr.current_state(), reference)
        assert stats.compiles_after_prewarm == 0
    finally:
        tr.close(unlink=True)


_CALLED = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?"
                     r"(%[\w.\-]+(?:, ?%[\w.\-]+)*)")


def _products_in_and_out_of_loops(hlo: str) -> tuple[int, int]:
    """A compiled program's matrix products (XLA's dots -- the CPU's, and those inside a GPU's
    Triton fusions -- and the GPU's cuBLAS calls): those reached through a while loop's body,
    and those reached from the entry computation otherwise."""
    computations, name = {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and (line.startswith("%") or line.startswith("ENTRY")):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    calls = {n: [c for m in _CALLED.findall("\n".join(lines)) for c in m.replace(" ", "").split(",")]
             for n, lines in computations.items()}
    bodies = set(re.findall(r"body=(%[\w.\-]+)", hlo))

    def products(root: str, skip: set) -> int:
        seen, todo, n = set(), [root], 0
        while todo:
            c = todo.pop()
            if c in seen or c in skip or c not in computations:
                continue
            seen.add(c)
            text = "\n".join(computations[c])
            n += text.count(" dot(") + text.count('custom_call_target="__cublas')
            todo += calls[c]
        return n

    inside = sum(products(b, set()) for b in bodies)
    return inside, products("ENTRY", bodies)


def test_a_sampled_step_runs_both_gradient_computations_through_one_loop_body(shm_name):
    """Two copies of the gradient computation in one program may be compiled differently and
    differ in their last bits with nothing wrong; the sampled step runs one compiled body
    twice: every matrix product of its program is inside a loop's body, as many as the plain
    step's, not twice as many. The control: a program with the gradient written out twice has
    its products outside any loop."""
    tr = make_trainer(shm_name, recheck_every=5)
    try:
        plain = _products_in_and_out_of_loops(tr.programs.step[0].as_text())
        inside, outside = _products_in_and_out_of_loops(tr.programs.sampled[0].as_text())
        assert plain[1] > 0 and inside > 0 and outside == 0
        assert inside < 2 * plain[1]  # the compiler may merge or split a product in a loop
        params, a, b = mlp.init(0), mlp.batches(0)(0), mlp.batches(0)(1)
        twice = jax.jit(lambda p, a, b: [jax.grad(mlp.loss)(p, x) for x in (a, b)])
        control = _products_in_and_out_of_loops(twice.lower(params, a, b).compile().as_text())
        assert control[0] == 0 and control[1] > 0
    finally:
        tr.close(unlink=True)


def test_a_gradient_fault_on_a_step_halted_behind_another_counts_as_overwritten(shm_name):
    """A NaN gradient planned for the step in flight behind one whose update found a damaged
    moment (that step is halted, and runs again without the NaN) reached nothing: the campaign
    counts it overwritten, not missed. The control: the same NaN on a step of its own is
    detected."""
    tr = make_trainer(shm_name, inject=True)
    try:
        campaign = Campaign(tr, {"grad_nonfinite": 2, "moment_flip": 1}, last_step=12, seed=5)
        grads = [f for f in campaign.plan if f.kind == "grad_nonfinite"]
        moment = next(f for f in campaign.plan if f.kind == "moment_flip")
        moment.step, grads[0].step, grads[1].step = 6, 7, 10
        campaign._avoid_cancelling(2, 12)
        stats = tr.run(12, campaign=campaign)
        assert [(i.step, i.action) for i in incidents(stats, IncidentKind.STATE)] == [
            (6, Action.REDONE_FROM_PARITY)]
        table = campaign.check(stats)
        assert table["grad_nonfinite"] == {"injected": 2, "detected": 1, "repaired": 2,
                                           "missed": 0, "unlocated": 0, "overwritten": 1}
        assert 7 in campaign.replayed and grads[1].detected and not grads[0].detected
    finally:
        tr.close(unlink=True)


def test_a_loss_with_aux_reports_it_for_every_committed_step(shm_name):
    """aux: the slice's example count (an integer: summed over devices) and the mean of its
    inputs (a float: averaged), checked against the whole batch on the host; a replay leaves one
    aux a step."""
    needs_devices(4)

    def loss(params, batch):
        x = batch["x"]
        return mlp.loss(params, batch), {"examples": jnp.int32(x.shape[0]), "mean_x": x.mean()}

    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=0)
    tr = Trainer(loss, opt, mlp.init(0), mlp.batches(0), scrub_every=5, has_aux=True,
                 shm_name=shm_name, devices=jax.devices()[:4])
    tr.prewarm()
    try:
        stats = tr.run(8, campaign=Once(4, lambda t: flip(t, "w0", "p", 3 * CHUNK + 1, bit=9)))
    finally:
        tr.close(unlink=True)
    assert stats.steps_replayed > 0 and sorted(stats.aux) == list(range(1, 9))
    for step, aux in stats.aux.items():
        x = mlp.batches(0)(step)["x"]
        assert int(aux["examples"]) == x.shape[0]
        np.testing.assert_allclose(aux["mean_x"], x.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "in-process-log"])
def test_a_loop_the_user_owns_pushes_its_batches_and_ends_as_run_does(shm_name, shared):
    """push(batch) from the user's own loop over an iterator: the same states as run() over
    batch_fn, also across a fault whose repair replays steps (from the log -- in shared memory,
    or without it in this process's memory: the iterator is read once)."""
    reference = fault_free(shm_name, 12)
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    example = mlp.batches(0)(1)
    tr = Trainer(mlp.loss, opt, mlp.init(0), example, shm_name=shm_name if shared else None,
                 snapshot_every=10, scrub_every=5, devices=jax.devices()[:1])
    tr.prewarm()
    try:
        with pytest.raises(RuntimeError, match="push"):
            tr.run(3)
        stream = iter(mlp.batches(0)(step) for step in range(1, 13))
        fault = Once(5, lambda t: flip(t, "w0", "p", 3 * CHUNK + 1, bit=9))
        for batch in stream:
            stats = tr.push(batch, campaign=fault)
            assert stats.steps_committed <= tr.pushed
        assert stats.steps_committed < 12  # steps were still in flight before the flush
        stats = tr.flush()
        assert stats.steps_committed == 12 and stats.steps_replayed > 0
        assert stats.compiles_after_prewarm == 0
        assert same_state(tr.current_state(), reference)
    finally:
        tr.close(unlink=True)


def test_a_restart_while_a_snapshot_is_being_sealed_keeps_none_of_the_old_run(shm_name,
                                                                              monkeypatch):
    """A seal runs on a thread of its own; a restart in the middle of one (a user's loop that
    pushed past a snapshot and did not flush) must not let it seal the old run's tensors under
    the new run's binding: the new run starts with no snapshot of its own (it takes one of its
    starting state first)."""
    from pimhbm.backup import HostBackup
    complete = HostBackup.complete

    def slow(self, slot):  # the seal outlasts the restart's start
        time.sleep(1.0)
        complete(self, slot)
    monkeypatch.setattr(HostBackup, "complete", slow)
    opt = inplace.adamw(3e-3, master_weights=True, chunk_elems=CHUNK, group=GROUP)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0)(1), shm_name=shm_name,
                 snapshot_every=10, devices=jax.devices()[:1])
    tr.prewarm()
    try:
        for step in range(1, 14):  # step 10's snapshot is sealed once step 11's verdict is read
            tr.push(mlp.batches(0)(step))
        assert tr.snapshots._sealing is not None  # the control: a seal is running
        tr.restart(mlp.init(1))
        tr.snapshots.wait()  # a seal the restart did not wait for would land by now
        assert tr.backup.newest() == []
    finally:
        tr.close(unlink=True)


def test_a_batch_of_another_structure_than_step_ones_is_refused():
    from pimhbm.recovery.feed import BatchFeed
    feed = BatchFeed(lambda step: {"x": np.zeros(4)} if step == 1 else {"x": np.zeros(4),
                                                                         "y": np.zeros(4)}, None, 1)
    assert list(feed(1)) == ["['x']"]
    with pytest.raises(ValueError, match=r"batch_fn\(2\) returned a batch of another structure"):
        feed(2)

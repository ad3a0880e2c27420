"""The recovery engine on the CPU: fault injection, repair, shared-memory backups, the fault
campaign (every fault found, located and repaired; the run ends bit-identical to a run without
faults; nothing compiles after prewarm) and a SIGKILL + resume."""

import os
import re
import signal
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pimhbm
from pimhbm import faults, inplace
from pimhbm.backup import HostBackup, specs_of
from pimhbm.campaign import KINDS, Campaign
from pimhbm.models import mlp
from pimhbm.recovery import Action, IncidentKind, Trainer

from conftest import cached_env, nan_at_step
from pull_chain import pull_chain

HERE = os.path.dirname(__file__)


def make_trainer(name, inject=False, resume=False, device_copy=True, **kwargs):
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=device_copy, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                 scrub_every=5, inject_gradients=inject, resume=resume, **kwargs)
    tr.prewarm()
    return tr


@pytest.fixture(scope="module")
def fault_free():
    """The fault-free run's state after 20 and 30 steps (make_trainer's settings), computed
    once for the tests that compare against it."""
    name = f"pimhbm_test_{uuid.uuid4().hex[:12]}"
    try:
        tr = make_trainer(name)
        tr.run(20)
        states = {20: tr.current_state()}
        tr.run(30)
        states[30] = tr.current_state()
        return states
    finally:
        HostBackup.unlink(name)


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k].tobytes() == b[k].tobytes() for k in a)


# -- fault injection ------------------------------------------------------------------------------

def test_injections_do_exactly_what_they_say(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    y = np.asarray(faults.flip_bit(jnp.asarray(x), 123, 30))
    diff = np.flatnonzero(x.view(np.uint32) != y.view(np.uint32))
    assert diff.tolist() == [123] and (x.view(np.uint32)[123] ^ y.view(np.uint32)[123]) == 1 << 30
    y = np.asarray(faults.overwrite(jnp.asarray(x), 1000, 1500, seed=7))
    changed = np.flatnonzero(x.view(np.uint8) != y.view(np.uint8))
    assert changed.min() >= 1000 and changed.max() < 2500 and changed.size > 1400
    z = np.asarray(faults.overwrite(jnp.asarray(x), 1000, 1500, seed=7))
    assert y.tobytes() == z.tobytes()  # deterministic from the seed
    b = rng.standard_normal(100).astype(ml_dtypes.bfloat16)
    for value, check in (("nan", np.isnan), ("inf", np.isposinf), ("-inf", np.isneginf)):
        c = np.asarray(faults.set_nonfinite(jnp.asarray(b), 42, value), np.float32)
        assert check(c[42]) and np.sum(~np.isfinite(c)) == 1
    w = np.asarray(faults.wipe(jnp.asarray(x), seed=3))
    assert np.mean(w.view(np.uint8) != x.view(np.uint8)) > 0.99
    with pytest.raises(IndexError):
        faults.flip_bit(jnp.asarray(x), 1000, 0)
    with pytest.raises(ValueError):
        faults.overwrite(jnp.asarray(x), 3990, 100, seed=1)


def test_repair_checks_the_source_and_the_target(rng):
    cb = 1024
    good = rng.standard_normal(5000).astype(np.float32)
    table = pimhbm.scan(good, cb).digests
    damaged = np.asarray(faults.flip_bit(jnp.asarray(good), 700, 5))  # chunk 2
    damaged = np.asarray(faults.flip_bit(jnp.asarray(damaged), 4100, 9))  # chunk 16
    backup = good.copy()
    backup_table = table
    bad_backup = np.asarray(faults.flip_bit(jnp.asarray(good), 4101, 1))  # chunk 16 damaged too
    chunks = jnp.asarray([2, 16, -1, 99], jnp.int32)
    (fixed, fixed_table), status = pimhbm.repair(chunks, (jnp.asarray(backup), backup_table),
                                                 (jnp.asarray(damaged), table), cb)
    assert np.asarray(status).tolist() == [pimhbm.REPAIRED, pimhbm.REPAIRED, pimhbm.NOT_LISTED,
                                           pimhbm.OUT_OF_RANGE]
    assert np.asarray(fixed).tobytes() == good.tobytes()
    (partly, _), status = pimhbm.repair(chunks[:2], (jnp.asarray(bad_backup), backup_table),
                                        (jnp.asarray(damaged), table), cb)
    assert np.asarray(status).tolist() == [pimhbm.REPAIRED, pimhbm.SOURCE_DAMAGED]
    assert not np.asarray(pimhbm.verify(partly, table, cb))[2]
    assert np.asarray(pimhbm.verify(partly, table, cb))[16]  # not copied from a damaged source


def test_packed_repair_checks_what_arrives(rng):
    """Chunks that arrive packed (as a replica sends them: entry k at row k) are checked
    against the digest rows that came with them and written to their place; a row damaged on
    the way is not written."""
    from pimhbm.repair import repair_packed

    cb = 1024  # 256 float32
    size = int(rng.integers(3000, 6000))  # a ragged last chunk
    good = rng.standard_normal(size).astype(np.float32)
    table = np.asarray(pimhbm.scan(good, cb).digests)
    nch = table.shape[0]
    listed = [nch - 1, 1, 3, -1]
    damaged = good.copy()
    for c in listed[:3]:
        damaged[c * 256 + int(rng.integers(0, min(256, size - c * 256)))] += 1.0
    rows = np.zeros((len(listed), 256), np.float32)
    rows_table = np.zeros((len(listed), 2), np.uint32)
    for k, c in enumerate(listed[:3]):
        part = good[c * 256:(c + 1) * 256]
        rows[k, :part.size] = part
        rows_table[k] = table[c]
    rows[2, 5] = np.nextafter(rows[2, 5], np.float32(np.inf))  # chunk 3 damaged on the way
    (fixed, fixed_table), status = repair_packed(
        jnp.asarray(listed, jnp.int32), (jnp.asarray(rows), jnp.asarray(rows_table)),
        (jnp.asarray(damaged), jnp.asarray(table)), cb)
    assert np.asarray(status).tolist() == [pimhbm.REPAIRED, pimhbm.REPAIRED,
                                           pimhbm.SOURCE_DAMAGED, pimhbm.NOT_LISTED]
    bad = np.asarray(pimhbm.verify(fixed, fixed_table, cb))
    assert np.flatnonzero(bad).tolist() == [3]
    with pytest.raises(ValueError, match="must hold 4 chunks of 1024 bytes"):
        repair_packed(jnp.asarray(listed, jnp.int32), (jnp.asarray(rows[:3]), rows_table[:3]),
                      (jnp.asarray(damaged), jnp.asarray(table)), cb)


# -- shared memory ----------------------------------------------------------------------------------

def test_region_memory_is_visible_to_jax_without_a_copy(shm_name, rng):
    x = rng.standard_normal((4, 33)).astype(np.float32)
    backup = HostBackup(shm_name, specs_of([("x", x)]), specs_of([("b", x)]), ring=2, create=True)
    offset = backup.offsets(0)[0]
    view = backup.region.numpy(offset, [4, 33], "float32")
    view[:] = x
    j = backup.snapshot_views(0)[0]
    assert j.unsafe_buffer_pointer() == backup.region.address + offset  # the same memory
    # Read through a JAX computation, bit for bit (a float sum of random values that nearly
    # cancel differs between summation orders beyond any fixed relative tolerance).
    assert np.asarray(jnp.copy(j)).tobytes() == x.tobytes()
    view[1, 2] += 1000.0  # a write on the NumPy side is seen by the JAX array
    seen = np.asarray(jnp.copy(j))
    assert seen[1, 2] == np.float32(x[1, 2] + np.float32(1000.0))
    assert seen.tobytes() == view.tobytes()
    # One handle at a time: another is refused while this one holds the region; once it is
    # given up, a new handle on the same name sees the same bytes.
    with pytest.raises(RuntimeError, match="in use by another process"):
        HostBackup(shm_name, specs_of([("x", x)]), specs_of([("b", x)]), ring=2, create=False)
    backup.close()
    again = HostBackup(shm_name, specs_of([("x", x)]), specs_of([("b", x)]), ring=2, create=False)
    assert np.asarray(again.snapshot_views(0)[0]).tobytes() == view.tobytes()
    again.close()
    with pytest.raises(ValueError, match="another state layout"):
        HostBackup(shm_name, specs_of([("y", x)]), specs_of([("b", x)]), ring=2, create=False)


def test_batch_log_ring(shm_name):
    spec = specs_of([("x", np.zeros(3, np.int32))])
    backup = HostBackup(shm_name, spec, spec, ring=4, create=True)
    for step in range(1, 10):
        backup.log_batch(step, [np.arange(3, dtype=np.int32) + step])
    assert backup.logged_batch(9)[0].tolist() == [9, 10, 11]
    assert backup.logged_batch(5) is None  # overwritten by step 9
    assert backup.last_logged_step() == 9
    with pytest.raises(ValueError, match="the log holds"):
        backup.log_batch(10, [np.zeros(4, np.int32)])


def test_the_snapshot_fence_passes_its_tree_through_and_refuses_results_not_its_buffers(rng):
    from pimhbm._ffi import ensure_registered
    from pimhbm.repair import snapshot_fence
    tree = {"a": rng.standard_normal((5, 7)).astype(np.float32),
            "b": rng.integers(0, 2**16, 9).astype(np.uint16).view(ml_dtypes.bfloat16)}
    out = jax.jit(snapshot_fence)(jax.tree.map(jnp.asarray, tree))
    for k in tree:
        assert np.asarray(out[k]).tobytes() == tree[k].tobytes(), k
    ensure_registered()
    two = jax.ffi.ffi_call("pimhbm_snapshot_fence", [jax.ShapeDtypeStruct((3,), jnp.int32)] * 2)
    with pytest.raises(Exception, match="1 buffers but 2 results"):
        jax.block_until_ready(jax.jit(two)(jnp.zeros((3,), jnp.int32)))
    wrong = jax.ffi.ffi_call("pimhbm_snapshot_fence", jax.ShapeDtypeStruct((4,), jnp.int32))
    with pytest.raises(Exception, match="result 0 is not the size of argument 0"):
        jax.block_until_ready(jax.jit(wrong)(jnp.zeros((3,), jnp.int32)))


def fence_result_bytes(hlo: str) -> list[int]:
    """The bytes of each snapshot fence's results in a compiled program's text."""
    sizes = {"s32": 4, "u32": 4, "f32": 4, "bf16": 2, "u16": 2, "u8": 1, "pred": 1}
    out = []
    for line in hlo.splitlines():
        if 'custom_call_target="pimhbm_snapshot_fence"' in line:
            shapes = line.split("= ", 1)[1].split("custom-call(", 1)[0]
            out.append(sum(sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                           for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shapes)))
    return out


def test_the_update_is_fenced_through_its_verdicts_counts_not_the_state_or_gradients(shm_name):
    """The fence before the in-place update's writes passes through the checks' counts (8
    bytes): passed through the gradients, XLA copied those it could not alias (on the GPU, 32
    MiB a step at the 8B layers). Control: the same measure of a fence over a gradient-sized
    tree sees its bytes."""
    from pimhbm.repair import snapshot_fence
    opt = inplace.adamw(1e-3, master_weights=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm_name, snapshot_every=5,
                 telemetry=None)
    tr.prewarm()
    for program in tr.programs.step.values():
        assert fence_result_bytes(program.as_text()) == [8]
    grads = {k: jnp.zeros(v.shape, v.dtype) for k, v in mlp.init(0).items()}
    control = jax.jit(snapshot_fence).lower(grads).compile().as_text()
    assert fence_result_bytes(control) == [sum(v.size * v.dtype.itemsize for v in grads.values())]
    stats = tr.run(12)  # two snapshots, each fenced
    assert stats.steps_committed == 12 and stats.snapshots >= 2


def test_the_snapshot_kept_is_checked_again_before_the_other_slot_is_overwritten(shm_name, rng):
    """Two sealed snapshots: the next one goes over the older. If the newer one's digest table
    changed in host memory since this process sealed it, the next goes over the newer instead
    (the older is the only one that verifies); the damage is found though nothing re-read the
    slot since its seal."""
    x = rng.standard_normal(8).astype(np.float32)
    table = np.arange(4, dtype=np.uint32)
    specs = specs_of([("x", x)]) + specs_of([("x digests", table)], digest_tables=True)
    backup = HostBackup(shm_name, specs, specs_of([("b", x)]), ring=2, create=True)
    for slot, step in ((0, 10), (1, 20)):
        backup.begin(slot, step)
        backup.region.numpy(backup.offsets(slot)[1], [4], "uint32")[:] = table + step
        backup.complete(slot)
    assert backup.slot_for_next() == 0  # control: both verify, the older is overwritten
    backup.region.numpy(backup.offsets(1)[1], [4], "uint32")[2] ^= 1 << 7  # one bit, after the seal
    assert not backup.verified(1) and backup.verified(0)
    assert backup.slot_for_next() == 1
    backup.close()


# -- the engine ---------------------------------------------------------------------------------

def test_fault_free_run_reports_nothing_and_compiles_nothing(shm_name):
    tr = make_trainer(shm_name)
    stats = tr.run(50)
    assert stats.incidents == [] and stats.steps_skipped == 0 and stats.steps_committed == 50
    assert stats.compiles_after_prewarm == 0
    assert stats.snapshots >= 4 and stats.scrubs == 10
    assert stats.losses[50] < 0.7 * stats.losses[1]  # it learns
    hlo = tr.hlo_text()
    assert re.findall(r"\b(conditional|send|recv|outfeed|infeed|xla_python_cpu_callback|"
                      r"xla_ffi_python_cpu_callback)\b", hlo) == []


@pytest.mark.parametrize("ndev", [1, 4])
def test_steps_are_waited_for_only_where_programs_could_hang(shm_name, monkeypatch, ndev):
    """The host waits for each step before queuing the next only on several virtual CPU
    devices (their programs share one thread pool); elsewhere -- one CPU device here, GPUs --
    steps stay queued ahead of the device, so it never idles for the host between steps."""
    if len(jax.devices()) < ndev:
        pytest.skip(f"needs {ndev} devices")
    waits = []
    real = jax.block_until_ready

    def counting(x):
        waits.append(sys._getframe(1).f_code.co_name)
        return real(x)

    tr = make_trainer(shm_name, devices=jax.devices()[:ndev])
    tr.run(2)
    monkeypatch.setattr(jax, "block_until_ready", counting)
    tr.run(8)
    settled = waits.count("settle")
    if ndev == 1 or jax.devices()[0].platform != "cpu":
        assert settled == 0, waits
    else:  # each of the 6 steps (and the scrub at step 5)
        assert settled >= 6, waits


def test_fault_campaign_ends_bit_identical_to_the_fault_free_run(shm_name):
    steps = 200
    reference = make_trainer(shm_name + "_ref", inject=True)
    ref_stats = reference.run(steps)
    ref_state = reference.current_state()
    reference.close(unlink=True)
    assert ref_stats.incidents == []

    tr = make_trainer(shm_name, inject=True)
    campaign = Campaign(tr, {kind: 50 for kind in KINDS}, last_step=steps, seed=20261129)
    stats = tr.run(steps, campaign=campaign)
    table = campaign.check(stats)
    for kind, row in table.items():
        assert row["injected"] >= 50, kind
        assert row["detected"] == row["injected"], (kind, row)
        assert row["repaired"] == row["injected"], (kind, row)
    actions = {(i.step, i.action) for i in stats.incidents if i.kind is IncidentKind.STATE}
    doubles = [f for f in campaign.plan if f.kind == "double_fault"]
    if len(tr.devices) > tr.shard:
        # A double fault damages one device's state and device copy: its replicas are healthy.
        assert stats.host_restores == 0 and stats.replica_repairs >= 1
        for f in doubles:
            assert f.device is not None
            assert (f.step, Action.REPAIRED_FROM_REPLICA) in actions, f
    else:  # one device (a single GPU): no replica, so a double fault needs the host snapshot
        assert stats.host_restores >= 1 and stats.replica_repairs == 0
        for f in doubles:
            assert (f.step, Action.RESTORED_FROM_SNAPSHOT) in actions, f
    assert stats.compiles_after_prewarm == 0
    assert same_state(tr.current_state(), ref_state), "the run did not end bit-identical"


def test_sigkill_mid_run_resumes_from_shared_memory(shm_name, tmp_path):
    worker = os.path.join(HERE, "crash_worker.py")
    # The session's compilation cache: the killed run and the resumed one load the programs the
    # reference run compiled.
    env = cached_env(dict(os.environ, PYTHONUNBUFFERED="1"))
    ref = tmp_path / "ref.npz"
    done = subprocess.run([sys.executable, worker, shm_name + "_ref", "60", str(ref)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    HostBackup.unlink(shm_name + "_ref")
    proc = subprocess.Popen([sys.executable, worker, shm_name, "60", str(tmp_path / "x.npz"),
                             "--pace", "0.02"], stdout=subprocess.PIPE, text=True, env=env)
    last = 0
    for line in proc.stdout:
        if line.startswith("step"):
            last = int(line.split()[1])
            if last >= 33:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and last < 60
    out = tmp_path / "resumed.npz"
    done = subprocess.run([sys.executable, worker, shm_name, "60", str(out), "--resume"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed_from = int(re.search(r"resumed from step (\d+)", done.stdout).group(1))
    assert 20 <= resumed_from <= last
    a, b = np.load(ref), np.load(out)
    assert sorted(a.files) == sorted(b.files)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a.files), "resume was not bit-identical"


def test_a_fault_on_one_device_is_located_to_that_device(shm_name, fault_free):
    """Data parallel over the 4 virtual CPU devices: each holds a copy of the state. A bit
    flipped in one device's copy makes every device skip (the verdict is global), is located to
    (device, tensor, chunk), is repaired, and the run ends as the fault-free one."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    ref_state = fault_free[30]

    class OneDevice:
        def before_step(self, trainer, step, attempt):
            if step == 12 and attempt == 1:
                trainer.inject("w1", "mu", faults.spec(faults.FLIP_BIT, offset=4 * 700 + 2, bit=5),
                               device=2)
            return None

        def before_scrub(self, trainer, step):
            pass

    tr = make_trainer(shm_name)
    stats = tr.run(30, campaign=OneDevice())
    state_incidents = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    assert state_incidents and state_incidents[0].step == 12
    assert state_incidents[0].locations == ((2, "w1", "mu", 700 // 256),)
    assert state_incidents[0].action is Action.REPAIRED_FROM_DEVICE_COPY
    assert same_state(tr.current_state(), ref_state)


@pytest.mark.parametrize("transport", ["collective", "peer"])
def test_a_double_fault_on_some_devices_is_repaired_from_a_healthy_replica(shm_name, rng, fault_free,
                                                                          transport):
    """A chunk damaged in both the state and the device copy of devices 1 and 3 (fresh random
    places): the engine pulls it from a device whose copy is healthy -- no host snapshot, no
    replay beyond the skipped steps -- and rewrites the damaged device copies; the run ends
    bit-identical. The same damage on every device falls back to the host snapshot. Both
    transports: XLA's psum, and the peer pull that reads the source device's memory."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    doubles = [d for d in (1, 3) if d < len(jax.devices())]
    ref_state = fault_free[30]
    leaf, tensor = ("w1", "nu"), (int(rng.integers(0, 4096)) * 4, int(rng.integers(0, 8)))
    offset, bit = tensor
    burst = int(rng.integers(0, 4096 * 4 - 1500))

    class Doubles:
        def before_step(self, trainer, step, attempt):
            if attempt != 1:
                return None
            if step == 9:  # one bit, state and copy, on devices 1 and 3
                for dev in doubles:
                    for copy in (False, True):
                        trainer.inject(*leaf, faults.spec(faults.FLIP_BIT, offset=offset, bit=bit),
                                       into_copy=copy, device=dev)
            if step == 17:  # a row burst in state and copy on device 0 only
                for copy in (False, True):
                    trainer.inject("w1", "p", faults.spec(faults.OVERWRITE, offset=burst // 2,
                                                          length=700, seed=5),
                                   into_copy=copy, device=0)
            if step == 24:  # the same flip on every device: no healthy replica
                for copy in (False, True):
                    trainer.inject("b1", "mu", faults.spec(faults.FLIP_BIT, offset=8, bit=3),
                                   into_copy=copy)
            return None

        def before_scrub(self, trainer, step):
            pass

    tr = make_trainer(shm_name, replica_transport=transport)
    stats = tr.run(30, campaign=Doubles())
    # Each fault is seen by its step and by the one in flight behind it (halted, same damage).
    seen = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    assert [i.step for i in seen] == [9, 10, 17, 18, 24, 25]
    assert [(i.action, i.sources, i.snapshot_step) for i in seen[0::2]] == \
        [(i.action, i.sources, i.snapshot_step) for i in seen[1::2]]
    state = seen[0::2]
    chunk = offset // 4 // 256
    assert state[0].locations == tuple((d, "w1", "nu", chunk) for d in doubles)
    assert state[0].action is Action.REPAIRED_FROM_REPLICA and state[0].sources == (0,)
    assert {l.device for l in state[1].locations} == {0}
    assert state[1].action is Action.REPAIRED_FROM_REPLICA and state[1].sources == (1,)
    assert state[2].action is Action.RESTORED_FROM_SNAPSHOT and state[2].snapshot_step is not None
    assert stats.replica_repairs == 1 + len(state[1].locations)
    assert stats.host_restores == 1
    assert tr.compiles == 0
    assert not [i for i in stats.incidents if i.kind is IncidentKind.DEVICE_COPY], \
        "the damaged device copies were rewritten with the repair, not found later by a scrub"
    assert same_state(tr.current_state(), ref_state)


@pytest.mark.parametrize("transport", ["collective", "peer"])
@pytest.mark.parametrize("fault_capacity", [64, 16])
def test_a_lost_shard_is_rebuilt_from_a_replica(shm_name, fault_capacity, fault_free, transport):
    """Device 2 loses w1's moments and master weights, in the state and in its device copy.
    With room to list every damaged chunk (64) they are pulled chunk by chunk from a healthy
    replica; with less (16: the list overflows) device 2's whole state is rebuilt from a
    device that saw no damage. Either way no host snapshot, and a bit-identical end. Both
    transports of one process: XLA's psum, and pulls from the source device's memory."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    lost = min(2, len(jax.devices()) - 1)
    ref_state = fault_free[20]

    class LostShard:
        def before_step(self, trainer, step, attempt):
            if step == 8 and attempt == 1:
                for tensor in ("mu", "master"):
                    for copy in (False, True):
                        trainer.inject("w1", tensor, faults.spec(faults.WIPE, seed=11),
                                       into_copy=copy, device=lost)
            return None

        def before_scrub(self, trainer, step):
            pass

    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm_name, snapshot_every=10,
                 scrub_every=5, fault_capacity=fault_capacity, replica_transport=transport)
    tr.prewarm()
    rebuild = tr.programs.rebuild[0].as_text()
    # The transport's own program: pulls from peer memory, or a psum (no pull).
    assert ("pimhbm_peer_pull" in rebuild) == (transport == "peer")
    if transport == "peer":  # one pull a tensor, each behind the one before on every device
        tensors = len(tr.layout.paths) * len(tr.layout.names)
        for program in (rebuild, tr.programs.replica[0].as_text()):
            assert len(pull_chain(program)) == tensors
    stats = tr.run(20, campaign=LostShard())
    state = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    assert state and state[0].step == 8
    assert {loc[0] for loc in state[0].locations} == {lost}
    assert stats.host_restores == 0
    if fault_capacity == 64:
        assert len(state[0].locations) == 2 * 36  # w1 is 96 x 96 = 36 chunks of 256
        assert state[0].action is Action.REPAIRED_FROM_REPLICA and state[0].sources == (0,)
        assert stats.replica_repairs == 72 and stats.replica_rebuilds == 0
    else:
        assert state[0].action is Action.REBUILT_FROM_REPLICA and state[0].sources == (0,)
        assert state[0].describe() == (f"device {lost} rebuilt whole from a healthy replica "
                                       "(device 0)")
        assert stats.replica_rebuilds == 1
    assert tr.compiles == 0
    assert same_state(tr.current_state(), ref_state)


def test_sharded_campaign_on_a_replica_by_shard_mesh(shm_name):
    """FSDP: 4 devices as 2 replicas x 2 shards, every parameter split over the shards. A
    campaign of every kind (on every device's shard), plus damage only one replica has -- a
    double fault on device 1, a row burst in state and copy on device 2, a shard wiped in state
    and copy on device 3 -- all located to (device, tensor, chunk of that device's shard) and
    repaired, the per-replica damage from the other replica's same shard; the run ends
    bit-identical to the same sharded run without faults, with no compilation after prewarm."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    steps = 30

    def trainer(name):
        opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
        tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=10,
                     scrub_every=5, inject_gradients=True, devices=jax.devices()[:4], shard=2,
                     fault_capacity=64)
        tr.prewarm()
        return tr

    ref = trainer(shm_name + "_ref")
    try:
        assert all(ref.sharded), "every MLP leaf splits over 2 shards"
        ref_stats = ref.run(steps)
        ref_state = ref.current_state()
        assert ref_stats.incidents == [] and ref_stats.steps_skipped == 0
        assert ref.compiles == 0
    finally:
        ref.close(unlink=True)

    tr = trainer(shm_name)
    campaign = Campaign(tr, {k: 3 for k in KINDS}, last_step=steps, seed=7)
    local = dict(((p, t), n) for p, t, n, _ in tr.tensor_info())
    assert local["w1", "mu"] == 96 * 96 // 2  # chunks index one device's shard

    class PerReplica:
        def before_step(self, trainer, step, attempt):
            grad = campaign.before_step(trainer, step, attempt)
            if attempt == 1 and step == 6:
                for copy in (False, True):
                    trainer.inject("w1", "mu", faults.spec(faults.FLIP_BIT, offset=4 * 3000 + 1,
                                                           bit=2), into_copy=copy, device=1)
            if attempt == 1 and step == 13:
                for copy in (False, True):
                    trainer.inject("w0", "p", faults.spec(faults.OVERWRITE, offset=900,
                                                          length=1500, seed=3),
                                   into_copy=copy, device=2)
            if attempt == 1 and step == 11:
                for copy in (False, True):
                    trainer.inject("w1", "master", faults.spec(faults.WIPE, seed=9),
                                   into_copy=copy, device=3)
            return grad

        def before_scrub(self, trainer, step):
            campaign.before_scrub(trainer, step)

    stats = tr.run(steps, campaign=PerReplica())
    found = campaign.check(stats)
    assert all(r["missed"] == 0 and r["repaired"] == r["injected"] for r in found.values()), found

    def incident(step):
        return next(i for i in stats.incidents if i.kind is IncidentKind.STATE and i.step == step)

    one = incident(6)
    assert (1, "w1", "mu", 3000 // 256) in one.locations
    assert {l[0] for l in one.locations if l[1:3] == ("w1", "mu")} == {1}
    # device 1's shard lives on 3 too
    assert one.action is Action.REPAIRED_FROM_REPLICA and 3 in one.sources
    burst = incident(13)
    assert {l for l in burst.locations if l[1:3] == ("w0", "p")} == {(2, "w0", "p", c)
                                                                   for c in range(1, 5)}
    assert burst.action is Action.REPAIRED_FROM_REPLICA and 0 in burst.sources
    wiped = incident(11)
    assert {l[3] for l in wiped.locations if l[:3] == (3, "w1", "master")} == set(range(18))
    assert wiped.action is Action.REPAIRED_FROM_REPLICA and 1 in wiped.sources
    doubles = [f for f in campaign.plan if f.kind == "double_fault"]  # one device each
    assert doubles and all(f.device is not None for f in doubles)
    assert stats.replica_repairs == 1 + 4 + 18 + sum(len(f.chunks) for f in doubles)
    assert tr.compiles == 0
    assert same_state(tr.current_state(), ref_state)
    tr.close()


def test_a_replica_transfer_that_fails_falls_back_to_the_host_snapshot(shm_name, fault_free):
    """A replica pull that fails -- a peer that does not answer within the peer ops' bounded
    wait surfaces as a device error of the repair program -- is reported, and the state comes
    from the host snapshot with a replay instead: no hang, a bit-identical end."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    ref_state = fault_free[20]

    class Double:
        def before_step(self, trainer, step, attempt):
            if step == 12 and attempt == 1:
                for copy in (False, True):
                    trainer.inject("w1", "mu", faults.spec(faults.FLIP_BIT, offset=4 * 33, bit=4),
                                   into_copy=copy, device=1)
            return None

        def before_scrub(self, trainer, step):
            pass

    tr = make_trainer(shm_name, replica_transport="peer")
    calls = []

    def unanswered(*args):
        calls.append(1)
        raise jax.errors.JaxRuntimeError("pimhbm.peer.pull: rank 1 waited 20000 ms for rank(s) 0 "
                                         "of 2 to publish their buffers")

    for current in (0, 1):
        tr.programs.replica[current] = unanswered
    stats = tr.run(20, campaign=Double())
    assert calls == [1]
    failed = [i for i in stats.incidents if i.kind is IncidentKind.TRANSPORT]
    assert len(failed) == 1 and "did not answer" not in failed[0].detail
    assert failed[0].action is Action.HOST_SNAPSHOT_INSTEAD and "waited 20000 ms" in failed[0].detail
    assert "host snapshot" in failed[0].describe()
    state = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    assert state[0].action is Action.RESTORED_FROM_SNAPSHOT and state[0].snapshot_step == 10
    assert stats.host_restores == 1 and stats.replica_repairs == 0
    assert tr.compiles == 0
    assert same_state(tr.current_state(), ref_state)


def test_a_damaged_snapshot_is_passed_over_for_the_older_one(shm_name, fault_free):
    """The newest host snapshot has a flipped bit (memory of the host region): the restore
    checks every snapshot's digests on the devices, passes it over for the one before, replays
    from there, and the run still ends as the fault-free one."""
    ref_state = fault_free[30]

    class Everywhere:
        def before_step(self, trainer, step, attempt):
            if step == 23 and attempt == 1:
                backup = trainer.backup
                trainer.snapshots.wait()  # the slot of step 20 may still be being sealed
                (newest, slot), _ = backup.newest()[:2]
                assert newest == 20
                spec = backup.tensors[0]
                raw = backup.region.numpy(backup.offsets(slot)[0], [spec.nbytes], "uint8")
                raw[11] ^= 1 << 3
                for copy in (False, True):  # a double fault on every device: host restore
                    trainer.inject("b1", "mu", faults.spec(faults.FLIP_BIT, offset=8, bit=3),
                                   into_copy=copy)
            return None

        def before_scrub(self, trainer, step):
            pass

    tr = make_trainer(shm_name)
    stats = tr.run(30, campaign=Everywhere())
    state = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    assert state[0].step == 23 and state[0].action is Action.RESTORED_FROM_SNAPSHOT
    assert state[0].snapshot_step == 10 and state[0].describe() == "restored from host snapshot @10"
    assert stats.host_restores == 1 and tr.compiles == 0
    assert same_state(tr.current_state(), ref_state)


def test_a_snapshot_is_trusted_only_once_the_next_step_verified_its_slot(shm_name, fault_free):
    """Damage that lands in the state while its snapshot is being copied (here: just before the
    copy starts, on the scrub of the snapshot's step) goes into the copy. The next step reads the
    same slot and finds it, so that snapshot is never marked complete and is taken again at the
    next step; a later host restore starts from the retaken one."""
    ref_state = fault_free[30]

    class AtTheSnapshot:
        def before_step(self, trainer, step, attempt):
            if step == 14 and attempt == 1:
                for copy in (False, True):  # a double fault: restore from the host snapshot
                    trainer.inject("b1", "mu", faults.spec(faults.FLIP_BIT, offset=8, bit=3),
                                   into_copy=copy)
            return None

        def before_scrub(self, trainer, step):
            if step == 10 and trainer.stats.steps_skipped == 0:
                trainer.inject("w1", "p", faults.spec(faults.FLIP_BIT, offset=4 * 100 + 1, bit=6))

    tr = make_trainer(shm_name)
    stats = tr.run(30, campaign=AtTheSnapshot())
    state = [i for i in stats.incidents if i.kind is IncidentKind.STATE]
    # (the step dispatched behind a skipped one reports the same damage: 11-12, 14-15)
    assert state[0].step == 11 and state[0].action is Action.REPAIRED_FROM_DEVICE_COPY
    restores = [i for i in state if i.action is Action.RESTORED_FROM_SNAPSHOT]
    assert {(i.step, i.snapshot_step) for i in restores} == {(14, 11), (15, 11)}
    assert stats.host_restores == 1 and tr.compiles == 0
    assert same_state(tr.current_state(), ref_state)
    for step, slot in tr.backup.newest():  # every snapshot marked complete verifies
        assert step != 10


def test_a_gradient_fault_hidden_in_a_poisoned_gradient_is_detected_not_located(shm_name):
    """A NaN written into one gradient value on a step whose forward pass already reads a
    parameter row overwritten with random bytes: the whole gradient is non-finite, more chunks than the
    summary lists. The step is skipped and replayed, the engine says the list was a prefix, and
    the campaign counts the NaN as detected (kept out of the update) but not located."""
    tr = make_trainer(shm_name, inject=True, fault_capacity=2)
    campaign = Campaign(tr, {"grad_nonfinite": 1}, last_step=12, seed=3)
    planned = campaign.plan[0]
    planned.step, planned.path, planned.element, planned.chunks = 8, "w1", 256 * 20 + 7, (20,)
    campaign._by_step = {8: [planned]}

    class Poisoned:
        def before_step(self, trainer, step, attempt):
            if step == 8 and attempt == 1:  # a failed row: random bytes, NaN patterns among them
                trainer.inject("w0", "p", faults.spec(faults.OVERWRITE, offset=0, length=2048,
                                                      seed=5))
            return campaign.before_step(trainer, step, attempt)

        def before_scrub(self, trainer, step):
            pass

    stats = tr.run(12, campaign=Poisoned())
    grads = [i for i in stats.incidents if i.kind is IncidentKind.GRADIENT and i.step == 8]
    assert grads and grads[0].unlisted
    assert ("w1", "gradient", 20) not in {(l.leaf, l.tensor, l.chunk) for l in grads[0].locations}
    row = campaign.check(stats)["grad_nonfinite"]
    assert row == {"injected": 1, "detected": 1, "repaired": 1, "missed": 0, "unlocated": 1,
                   "overwritten": 0}


def test_a_fault_list_is_the_first_non_zero_entries_of_the_concatenated_maps(rng):
    """One pimhbm_fault_list call against NumPy on fresh random maps: no leaf, one, many (more
    than one counting launch holds on a GPU), ragged sizes across its ranges of 8192 entries,
    densities from none to all, lists shorter and longer than the entries; its counts are the
    maps' non-zero entries and the sum of their values (saturating at int32's largest)."""
    from pimhbm.recovery.summary import listed

    int32_max = np.iinfo(np.int32).max
    for leaves, largest in ((0, 1), (1, 40000), (5, 20000), (300, 60)):
        for density in (0.0, 1e-4, 0.01, 1.0):
            sizes = rng.integers(0, largest + 1, leaves)
            maps = [np.where(rng.random(n) < density, rng.integers(1, 1 << 20, n), 0)
                    .astype(np.int32) for n in sizes]
            flat = np.concatenate(maps) if maps else np.zeros((0,), np.int32)
            where = np.flatnonzero(flat)
            for k in (1, 7, 64):
                got = jax.jit(lambda ms: listed(ms, k))([jnp.asarray(m) for m in maps])
                want = np.full(k, -1)
                want[:min(k, where.size)] = where[:k]
                what = (leaves, density, k)
                assert np.asarray(got.faults.index).tolist() == want.tolist(), what
                assert np.asarray(got.faults.value).tolist() == np.where(
                    want >= 0, flat[np.maximum(want, 0)] if flat.size else 0, 0).tolist(), what
                assert int(got.nonzero) == where.size, what
                assert int(got.total) == min(int(flat.sum(dtype=np.int64)), int32_max), what


def test_a_step_summary_has_no_reduction_or_concatenation_of_the_maps_whatever_the_leaves():
    """The step's summary counts and lists faults over every leaf's map by one call a list: the
    compiled summary holds no reduction and no concatenation, for 2 leaves as for 7 (XLA would
    run a reduction of a concatenation as one launch a leaf, every step). Control: the regex
    finds the reduction of a summary that sums the maps itself."""
    from types import SimpleNamespace
    from pimhbm.recovery.summary import inplace_summary

    def ops(leaves: int, summed: bool = False) -> list[str]:
        maps = {f"w{i}": jnp.zeros((100 + 3 * i,), jnp.int32) for i in range(leaves)}
        treedef = jax.tree.structure(maps)

        def summary(faults, grads):
            report = SimpleNamespace(applied=jnp.bool_(True), committed=jnp.bool_(True),
                                     digest_faults=jnp.int32(0), grad_nonfinite=jnp.int32(0),
                                     kept=jnp.int32(0), fault_maps=faults,
                                     grad_nonfinite_maps=grads, suspect=jnp.int32(0),
                                     scalars=jnp.array([1e-3, 0.1, 0.001], jnp.float32))
            out = inplace_summary(report, treedef, 8, [], jnp.int32(0))
            if summed:
                flat = jnp.concatenate([m for m in jax.tree.leaves(grads)])
                out = out._replace(grad_nonfinite=jnp.sum(flat, dtype=jnp.int32))
            return out

        hlo = jax.jit(summary).lower(maps, maps).compile().as_text()
        return re.findall(r"\b(reduce|concatenate)\(", hlo)

    assert ops(2) == [] and ops(7) == []
    assert "reduce" in ops(7, summed=True)


def test_a_step_that_fails_on_every_replay_stops_the_run_with_a_clear_error(shm_name):
    """A batch with a NaN in it makes the same gradient non-finite on every replay: not a
    transient fault. The run stops after max_skips skips of that step, naming the step and
    what came back, instead of replaying it for ever; the steps before it committed."""
    batch_fn = nan_at_step(mlp.batches(0), 7)
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), batch_fn, shm_name=shm_name, max_skips=3)
    tr.prewarm()
    with pytest.raises(pimhbm.recovery.PersistentFault,
                       match=r"step 7 was skipped 3 times in a row.*non-finite gradient values "
                             r"or new values \(in b0 chunk 0, .*comes back on every replay\. "
                             r"A gradient .* loss diverged") as err:
        tr.run(12)
    assert err.value.step == 7 and err.value.skips == 3
    assert tr.stats.steps_committed == 6 and tr.next_step == 7
    assert all(i.kind is IncidentKind.GRADIENT for i in err.value.incidents)
    with pytest.raises(ValueError, match="max_skips=1"):
        Trainer(mlp.loss, opt, mlp.init(0), batch_fn, max_skips=1)


def test_two_slots_hold_a_step_whose_learning_rate_is_not_finite_and_say_so(shm_name):
    """A schedule that is NaN from step 4: the two-slot update commits nothing (before, it wrote
    NaN parameters), and after max_skips the error names the learning rate, not a device."""
    opt = pimhbm.update.adamw(lambda count: jnp.where(count >= 4, jnp.nan, 3e-3),
                              master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm_name, max_skips=3)
    tr.prewarm()
    with pytest.raises(pimhbm.recovery.PersistentFault,
                       match=r"step 4 was skipped 3 times.*a learning rate or bias correction "
                             r"that could not make finite values.*schedule value"):
        tr.run(8)
    assert tr.stats.steps_committed == 3 and tr.stats.host_restores == 0
    assert all(np.isfinite(v.astype(np.float32)).all() for v in tr.current_state().values())
    # The two-slot kernel runs whatever the verdict, on usable scalars where the step's are not
    # (pimhbm.step_scalars.for_the_kernel): its count of non-finite values stays the gradients'
    # and the settings' own, so the learning rate's is the only incident.
    assert {(i.step, i.kind) for i in tr.stats.incidents} == {(4, IncidentKind.UPDATE)}


def test_the_gradient_fault_hook_leaves_every_gradient_alone_when_told_to():
    """The step's in-graph hook (kind 0: no fault) must pass every gradient through bit for
    bit. Its op updates in place through XLA's aliasing, which XLA does not always grant: on
    the GPU this model's gradients came out of the hook as uninitialised memory (NaN/Inf
    among it, so every step of the demo was skipped). The handlers now copy where XLA did not
    alias."""
    from pimhbm_cli.data import corpus_bytes
    from pimhbm.models import llama3
    from pimhbm.train import text_batches

    cfg = llama3.tiny(layers=2, hidden=64)
    params = llama3.init(jax.random.key(0), cfg)
    batch = {k: jnp.asarray(v) for k, v in text_batches(corpus_bytes(), 4, 32, 0)(1).items()}
    grad = jax.grad(lambda p, b: llama3.loss(p, b, cfg))
    spec = jnp.zeros(8, jnp.int32)
    plain = jax.jit(grad)(params, batch)
    hooked = jax.jit(lambda p, b: jax.tree.map(lambda g: faults.inject_in_graph(g, spec),
                                               grad(p, b)))(params, batch)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(plain)[0], jax.tree.leaves(hooked)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)


def test_the_ipc_transport_is_for_several_processes():
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    with pytest.raises(ValueError, match="replica_transport='ipc' pulls from another process"):
        Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), replica_transport="ipc")
    with pytest.raises(ValueError, match="'collective', 'peer' or 'ipc'"):
        Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), replica_transport="nccl")


def test_without_device_copies_every_fault_is_repaired_from_a_replica(shm_name, fault_free):
    """Replicas instead of a device copy (pimhbm.update.adamw(device_copy=False) on a replica axis):
    the update writes no copy; each damaged chunk -- flips, bursts, on one device each -- is
    pulled from another replica, and the run ends bit-identical to the fault-free run *with*
    device copies (the copy never enters the mathematics)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (4 replicas)")
    tr = make_trainer(shm_name, inject=True, device_copy=False)
    assert tr.state.opt.device_copy is None and len(tr.devices) // tr.shard == 4
    with pytest.raises(ValueError, match="keeps no device copy"):
        tr.inject("w0", "p", faults.spec(faults.FLIP_BIT, offset=0, bit=1), into_copy=True)
    counts = {k: 3 for k in KINDS}
    campaign = Campaign(tr, counts, last_step=30, seed=20261130)
    assert not [f for f in campaign.plan if f.kind == "double_fault"]
    state_faults = [f for f in campaign.plan if f.kind != "grad_nonfinite"]
    assert state_faults and all(f.device is not None for f in state_faults)
    stats = tr.run(30, campaign=campaign)
    table = campaign.check(stats)
    assert sorted(table) == sorted(k for k in KINDS if k != "double_fault")
    for kind, row in table.items():
        assert row["injected"] == 3 and row["repaired"] == 3, (kind, row)
    assert stats.host_restores == 0 and stats.replica_repairs >= len(state_faults)
    assert all(i.action is Action.REPAIRED_FROM_REPLICA
               for i in stats.incidents if i.kind is IncidentKind.STATE)
    assert tr.compiles == 0
    assert same_state(tr.current_state(), fault_free[30])
    tr.close()


def test_without_device_copies_a_replica_axis_is_required():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    opt = pimhbm.update.adamw(3e-3, device_copy=False, chunk_elems=256)
    with pytest.raises(ValueError, match="needs more devices than shard=2"):
        Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), devices=jax.devices()[:2], shard=2)


@pytest.mark.parametrize("ndev,shard", [(4, 1), (4, 2)])
def test_the_step_takes_the_mean_over_the_whole_batch(rng, ndev, shard):
    """Each device differentiates its slice's loss divided by the device count, and the sums go
    over every device: the step's loss and gradients are the whole batch's mean, in data
    parallelism and with FSDP. After one step mu = (1 - b1) g, so a wrong scale (a missing or
    double division) shows in mu; AdamW's update itself would hide it."""
    if len(jax.devices()) < ndev:
        pytest.skip(f"needs {ndev} devices")
    params = mlp.init(int(rng.integers(1 << 30)))
    x = rng.standard_normal((64, 32)).astype(np.float32)
    batch = {"x": x, "y": rng.integers(0, 10, 64).astype(np.int32)}
    b1 = 0.9  # the gradients' code is the same for both kinds of state: one copy's, faster
    opt = inplace.adamw(1e-3, b1=b1, master_weights=True, chunk_elems=256, group=0)
    tr = Trainer(mlp.loss, opt, params, lambda step: batch, snapshot_every=0, scrub_every=0,
                 devices=jax.devices()[:ndev], shard=shard, telemetry=None)
    tr.prewarm()
    stats = tr.run(1)
    loss, grads = jax.value_and_grad(mlp.loss)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    np.testing.assert_allclose(stats.losses[1], float(loss), rtol=1e-5)
    state = tr.current_state()
    for path, g in grads.items():
        g = np.asarray(g, np.float32)
        mu = state[f"{path}/mu"].reshape(g.shape)
        # The devices' bf16 gradients are summed in bf16: equal to the whole batch's to bf16
        # rounding, never off by a factor.
        np.testing.assert_allclose(mu / (1 - b1), g, rtol=2e-2, atol=2e-2 * np.abs(g).max())
        assert np.linalg.norm(mu / (1 - b1)) == pytest.approx(np.linalg.norm(g), rel=1e-2)


def test_a_closed_trainer_is_freed(shm_name):
    """Nothing outside a Trainer keeps it (and its device state) alive once it is closed: the
    compile counter listens to jax.monitoring only while a run goes on. The positive control: a
    listener that holds a trainer, left registered (as a listener bound to the trainer once was),
    keeps that trainer alive."""
    import gc
    import weakref

    def closed_trainer(name):
        tr = make_trainer(name)
        tr.run(3)
        assert tr.stats.steps_committed == 3
        tr.close()
        return tr

    tr = closed_trainer(shm_name)
    ref = weakref.ref(tr)
    del tr
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())

    kept = closed_trainer(shm_name + "k")
    listener = lambda event, duration, trainer=kept, **kwargs: None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    ref = weakref.ref(kept)
    del kept
    gc.collect()
    try:
        assert ref() is not None  # the leak the test above would catch
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        HostBackup.unlink(shm_name + "k")


# -- the engine's own device state ------------------------------------------------------------------

def _per_device(tr, values, like):
    """A replicated int32 array whose copy on device d holds values[d] (as a flip on one
    device leaves it)."""
    parts = [jax.device_put(np.asarray(v, np.int32), d) for v, d in zip(values, tr.devices)]
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, parts)


@pytest.mark.parametrize("what", ["halted", "step"])
def test_a_flipped_bit_in_the_engines_counters_ends_in_the_same_run(shm_name, fault_free, what):
    """A bit of the halt flag set on one device holds every device's step back (the gate is
    global) and the steps are replayed; a bit of one step-counter copy is outvoted. Either way
    the run ends bit-identical."""
    from pimhbm.recovery.traced import TrainState
    tr = make_trainer(shm_name)
    tr.run(12)
    state = tr.state
    n = len(tr.devices)
    if what == "halted":
        flags = [0] * n
        flags[n - 1] = 1 << 7
        state = TrainState(state.opt, _per_device(tr, flags, state.halted))
    else:
        copies = np.asarray(state.opt.step_copies.addressable_shards[0].data)
        flipped = [copies.copy() for _ in range(n)]
        flipped[0][1] ^= 1 << 12
        opt = state.opt
        state = TrainState(pimhbm.update.AdamWState(opt.slots, opt.current,
                                             _per_device(tr, flipped, opt.step_copies),
                                             opt.device_copy), state.halted)
    tr.state = state
    tr.run(30)
    assert same_state(tr.current_state(), fault_free[30])
    # The flag was seen (steps held back and replayed); the outvoted copy held nothing back.
    assert (tr.stats.steps_skipped > 0) == (what == "halted")
    tr.close()


def test_what_the_engine_does_is_logged_and_prewarm_says_how_far_it_is(shm_name, fault_free,
                                                                        caplog):
    """Prewarm tells how many programs of how many it has compiled; detection, repair, replay
    and each snapshot go to the "pimhbm.recovery" logger (and the snapshots' own), never to
    stdout."""
    import logging

    class OneFlip:
        def before_step(self, trainer, step, attempt):
            if step == 12 and attempt == 1:
                trainer.inject("w1", "mu", faults.spec(faults.FLIP_BIT, offset=4 * 700 + 2, bit=5))
            return None

        def before_scrub(self, trainer, step):
            pass

    seen = []
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm_name, snapshot_every=10,
                 scrub_every=5)
    tr.prewarm(progress=lambda done, total, what: seen.append((done, total, what)))
    total = len(tr.programs)
    assert [d for d, _, _ in seen] == list(range(1, total + 1))
    assert {t for _, t, _ in seen} == {total}
    assert {"the step", "the scrub", "a repair", "a snapshot"} <= {w for _, _, w in seen}
    with caplog.at_level(logging.INFO, logger="pimhbm"):
        stats = tr.run(20, campaign=OneFlip())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert stats.incidents and "step 12: state at device" in text and "w1/mu chunk 2" in text
    assert "replaying steps 12-" in text
    assert "snapshot in slot" in text
    assert tr.current_state().keys() == fault_free[20].keys()


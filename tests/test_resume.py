"""Resume trusts nothing in the shared-memory region it has not checked: each way the region
can be wrong -- tampered, from another run, another user's, in use, damaged at a random byte --
ends in a clear error or in a run bit-identical to the uninterrupted one."""

import gc
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pimhbm
from conftest import uninterrupted_state
from pimhbm.backup import HostBackup, RegionError
from pimhbm.models import mlp
from pimhbm.recovery import Trainer

STEPS = 30


def make_trainer(name, resume=False, seed=0, prewarm=True):
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(seed), mlp.batches(seed), shm_name=name,
                 snapshot_every=10, scrub_every=5, resume=resume, telemetry=None,
                 devices=jax.devices()[:1])
    if prewarm:
        tr.prewarm()
    return tr


@pytest.fixture(scope="module")
def uninterrupted():
    return uninterrupted_state(make_trainer, STEPS)


def same_state(a, b):
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def crashed_run(name, steps=25):
    """A run stopped after ``steps`` (snapshots of steps 10 and 20 complete, batches logged to
    ``steps``), its region left behind as a killed process leaves it."""
    tr = make_trainer(name)
    tr.run(steps)
    assert sorted(s for s, _ in tr.backup.newest()) == [10, 20]
    tr.close()
    return tr.backup


def slot_of(backup, step):
    return next(slot for s, slot in backup.newest() if s == step)


def resume_and_finish(name):
    tr = make_trainer(name, resume=True)
    resumed = tr.next_step - 1
    tr.run(STEPS)
    state = tr.current_state()
    tr.close()
    return resumed, state


def test_tensors_rewritten_with_their_digests_are_not_resumed_from(shm_name, uninterrupted):
    backup = crashed_run(shm_name)
    slot = slot_of(backup, 20)
    spec = backup.tensors[0]  # the first leaf's parameters, then its digest table
    p, table = backup.snapshot_arrays(slot)[:2]
    p[...] = 0
    table[...] = np.asarray(pimhbm.scan(jnp.asarray(p), 256 * p.dtype.itemsize).digests)
    assert spec.name.endswith("/p") and backup.tensors[1].digest_table
    resumed, state = resume_and_finish(shm_name)
    assert resumed == 10 and same_state(state, uninterrupted)


def test_with_both_slots_tampered_the_resume_refuses(shm_name):
    backup = crashed_run(shm_name)
    for _, slot in backup.newest():
        p, table = backup.snapshot_arrays(slot)[:2]
        p[...] = 0
        table[...] = np.asarray(pimhbm.scan(jnp.asarray(p), 256 * p.dtype.itemsize).digests)
    with pytest.raises(RuntimeError, match=r"no host snapshot verifies.*step 20 fails its check"
                                           r".*step 10 fails its check"):
        make_trainer(shm_name, resume=True, prewarm=False)


def test_another_runs_region_is_refused(shm_name):
    crashed_run(shm_name)
    with pytest.raises(RegionError, match="written by another run"):
        make_trainer(shm_name, resume=True, seed=1, prewarm=False)  # same shapes, other seed


def test_tensors_copied_from_another_runs_region_are_not_used(shm_name, uninterrupted):
    backup = crashed_run(shm_name)
    other = make_trainer(shm_name + "o", seed=1)  # the same shapes, another seed
    try:
        other.run(20)
        other.close()
        for mine, theirs in zip(backup.snapshot_arrays(slot_of(backup, 20)),
                                other.backup.snapshot_arrays(slot_of(other.backup, 20))):
            mine[...] = theirs  # tensors and tables: the other run's MAC does not follow them
        theirs = other.backup._slot_header(slot_of(other.backup, 20))
        backup._slot_header(slot_of(backup, 20))[:] = theirs  # nor does its slot header
        resumed, state = resume_and_finish(shm_name)
        assert resumed == 10 and same_state(state, uninterrupted)
    finally:
        HostBackup.unlink(shm_name + "o")


def test_a_changed_step_field_is_not_believed(shm_name, uninterrupted):
    backup = crashed_run(shm_name)
    header = backup._slot_header(slot_of(backup, 20))
    header[:8] = np.frombuffer(np.int64(100).tobytes(), np.uint8)
    resumed, state = resume_and_finish(shm_name)
    assert resumed == 10 and same_state(state, uninterrupted)


def test_a_flipped_batch_record_is_made_again(shm_name, uninterrupted, caplog):
    backup = crashed_run(shm_name)
    record = 23 % backup.ring
    base = backup.log_base + record * backup.record_bytes + backup.batch_offsets[0]
    raw = backup.region.numpy(base, [backup.batch[0].nbytes], "uint8")
    raw[17] ^= 1 << 4
    resumed, state = resume_and_finish(shm_name)
    assert resumed == 20 and same_state(state, uninterrupted)
    assert "logged batch of step 23" in caplog.text and "fails its check" in caplog.text


def test_a_region_another_user_may_write_is_refused(shm_name):
    fd = os.open(f"/dev/shm/{shm_name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        os.fchmod(fd, 0o666)
        with pytest.raises(RuntimeError, match="exists already"):
            make_trainer(shm_name, prewarm=False)
        with pytest.raises(RuntimeError, match=r"owned by uid \d+ with mode 0666.*mode 0600"):
            make_trainer(shm_name, resume=True, prewarm=False)
        os.fchmod(fd, 0o600)
        if os.geteuid() == 0:  # another owner, mode 0600
            os.fchown(fd, 12345, 12345)
            with pytest.raises(RuntimeError, match="owned by uid 12345"):
                make_trainer(shm_name, resume=True, prewarm=False)
    finally:
        os.close(fd)


CONTENDER = """
import sys
from pimhbm import _core
name, how = sys.argv[1], sys.argv[2]
try:
    _core.ShmRegion.create(name, 4096) if how == "create" else _core.ShmRegion.open(name)
except RuntimeError as err:
    print("refused:", err)
    sys.exit(0)
sys.exit(1)
"""


def test_a_second_process_cannot_take_a_region_in_use(shm_name, uninterrupted):
    tr = make_trainer(shm_name)
    tr.run(12)
    for how, why in (("create", "exists already"), ("open", "in use by another process")):
        r = subprocess.run([sys.executable, "-c", CONTENDER, shm_name, how], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and why in r.stdout, r.stdout + r.stderr
    tr.run(STEPS)  # the run goes on undisturbed (no SIGBUS: nothing resized its region)
    assert same_state(tr.current_state(), uninterrupted)
    tr.close()


def used_ranges(backup):
    """(kind, offset, length) of every byte of the region that holds something."""
    from pimhbm.backup import _HEADER, _MAC_BYTES, _RECORD, _SLOT

    out = [("header", 0, _HEADER.size + _MAC_BYTES)]
    for slot in (0, 1):
        out.append(("slot header", backup.slot_base[slot], _SLOT.size))
        for off, t in zip(backup.offsets(slot), backup.tensors):
            out.append(("digest table" if t.digest_table else "tensor", off, t.nbytes))
    for r in range(backup.ring):
        base = backup.log_base + r * backup.record_bytes
        out.append(("record header", base, _RECORD.size))
        out += [("batch", base + off, t.nbytes) for off, t in zip(backup.batch_offsets, backup.batch)]
    return out


def test_a_bit_flipped_anywhere_in_the_region_never_ends_in_another_state(shm_name, rng,
                                                                          uninterrupted):
    """20 fresh positions a run, over every kind of used byte: each trial resumes and runs on,
    and ends bit-identical to the uninterrupted run or stops with a clear error."""
    crashed_run(shm_name)
    tr = make_trainer(shm_name, resume=True)  # one compiled trainer; the region is reset each trial
    region = tr.backup.region.numpy(0, [tr.backup.nbytes], "uint8")
    pristine = region.copy()
    ranges = used_ranges(tr.backup)
    kinds = sorted({k for k, _, _ in ranges})
    outcomes = []
    for trial in range(20):
        kind = kinds[trial % len(kinds)]
        of_kind = [r for r in ranges if r[0] == kind]
        _, off, n = of_kind[int(rng.integers(len(of_kind)))]
        at, bit = off + int(rng.integers(n)), int(rng.integers(8))
        region[:] = pristine
        region[at] ^= 1 << bit
        try:
            tr.resume()
            tr.run(STEPS)
        except (RegionError, RuntimeError) as err:
            assert "pimhbm" in type(err).__module__ or str(err), (kind, at, bit)
            outcomes.append((kind, "error"))
            continue
        assert same_state(tr.current_state(), uninterrupted), (kind, at, bit)
        outcomes.append((kind, "identical"))
    tr.close()
    assert {k for k, _ in outcomes} == set(kinds)
    assert ("header", "error") in outcomes  # the header is the one place nothing stands in for


# -- the snapshot op's checks ---------------------------------------------------------------------

@pytest.mark.parametrize("offset", [2**63 - 8, 2**62, 4096 - 15, -1])
def test_a_snapshot_offset_outside_the_region_is_an_error(shm_name, offset):
    region = pimhbm._core.ShmRegion.create(shm_name, 4096)
    x = jnp.arange(4, dtype=jnp.float32)  # 16 bytes
    with pytest.raises(Exception, match="does not fit in the region of 4096 bytes"):
        jax.block_until_ready(pimhbm.backup_snapshot([x], region, [offset]))
    # Positive control: the last offset that fits is copied, bit for bit.
    jax.block_until_ready(pimhbm.backup_snapshot([x], region, [4096 - 16]))
    pimhbm._core.snapshot_wait()
    assert region.numpy(4096 - 16, [4], "float32").tobytes() == np.asarray(x).tobytes()


def test_a_view_larger_than_the_region_is_refused(shm_name):
    region = pimhbm._core.ShmRegion.create(shm_name, 4096)
    for offset, shape in [(0, [2**62, 4]), (8, [1024]), (2**63 - 8, [2])]:
        with pytest.raises(IndexError, match="region of 4096 bytes"):
            region.numpy(offset, shape, "float32")
    assert region.numpy(8, [1022], "float32").shape == (1022,)  # the largest that fits


def test_a_snapshot_program_whose_region_is_gone_is_an_error(shm_name):
    region = pimhbm._core.ShmRegion.create(shm_name, 4096)
    x = jnp.arange(4, dtype=jnp.float32)
    snap = jax.jit(lambda a: pimhbm.backup_snapshot([a], region, [64]))
    jax.block_until_ready(snap(x))  # while the region lives, the program copies
    pimhbm._core.snapshot_wait()
    assert region.numpy(64, [4], "float32").tobytes() == np.asarray(x).tobytes()
    gone = region.id
    del region
    gc.collect()
    with pytest.raises(Exception, match=f"region \\(id {gone}\\) is gone"):
        jax.block_until_ready(snap(x + 1))

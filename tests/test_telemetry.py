"""Hardware telemetry against a stand-in NVML (csrc/tests/nvml_standin.cc, compiled here):
readings field by field, the `pimhbm health` command, driver events, and the recovery
engine's reaction -- a suspect device and an immediate scrub, or, for a fatal event or a
device error, DeviceFailure and a resume from the host snapshot."""

import ctypes
import json
import os
import shutil
import subprocess
import time

import jax
import pytest

import pimhbm
import pimhbm_cli as cli
from pimhbm.backup import HostBackup
from pimhbm.models import mlp
from pimhbm.recovery import Action, DeviceFailure, IncidentKind, Trainer
from pimhbm.telemetry import FIELDS, FLAGS, Monitor, health

HERE = os.path.dirname(__file__)
SOURCE = os.path.join(HERE, "..", "csrc", "tests", "nvml_standin.cc")


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """The stand-in library's path and its script (ctypes over the same loaded library)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in NVML")
    path = str(tmp_path_factory.mktemp("nvml") / "libnvml_standin.so")
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", path, SOURCE, "-pthread"],
                   check=True)
    lib = ctypes.CDLL(path)
    lib.standin_set.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulonglong]
    lib.standin_event.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.standin_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.path = path
    return lib


def script(lib, rng, devices):
    """Random values for every field of every device; returns them."""
    lib.standin_reset(devices)
    want = []
    for d in range(devices):
        values = {}
        for name in FIELDS:
            v = int(rng.integers(0, 2)) if name in FLAGS else (
                int(rng.integers(0, 5)) if name == "recovery_action" else int(rng.integers(0, 10**6)))
            lib.standin_set(d, name.encode(), v)
            values[name] = bool(v) if name in FLAGS else v
        want.append(values)
    return want


def wait_for_a_reading(lib, seconds=5.0):
    """Until a reading of every device ends after this call: then the monitor's first (the
    counters' baseline, maybe under way now) is over, and a counter changed after it is a
    change, not part of the baseline."""
    before, end = lib.standin_readings(), time.monotonic() + seconds
    while lib.standin_readings() == before and time.monotonic() < end:
        time.sleep(0.002)
    assert lib.standin_readings() > before, "the monitor never read the devices"


def wait_for(monitor, n, seconds=5.0):
    got, end = [], time.monotonic() + seconds
    while len(got) < n and time.monotonic() < end:
        got += monitor.drain()
        time.sleep(0.005)
    return got


def test_without_nvml_everything_says_unavailable():
    h = health("/nonexistent/libnvidia-ml.so.1")
    assert not h.available and h.devices == []
    assert "NVML not loaded" in h.reason
    m = Monitor("/nonexistent/libnvidia-ml.so.1")
    assert not m.available and m.drain() == [] and m.status().startswith("unavailable: NVML not loaded")


def test_health_reads_every_field(standin, rng):
    want = script(standin, rng, 3)
    h = health(standin.path)
    assert h.available, h.reason
    assert [d.index for d in h.devices] == [0, 1, 2]
    for d, values in zip(h.devices, want):
        assert d.name == f"Stand-in GPU {d.index}" and d.uuid.startswith("GPU-")
        for name, v in values.items():
            assert getattr(d, name) == v, (d.index, name)
            assert type(getattr(d, name)) is (bool if name in FLAGS else int), name
        assert d.unavailable == {}


def test_concerns_and_unsupported_fields(standin):
    standin.standin_reset(2)
    for d in (0, 1):
        standin.standin_set(d, b"ecc_mode_current", 1)
    standin.standin_set(1, b"dram_volatile_uncorrected", 2)
    standin.standin_set(1, b"remap_pending", 1)
    standin.standin_fail(b"nvmlDeviceGetRetiredPages", 3)
    h = health(standin.path)
    assert h.devices[0].concerns == []
    assert h.devices[1].concerns == ["dram_volatile_uncorrected = 2", "remap_pending"]
    for d in h.devices:
        assert d.retired_pages_single_bit is None and d.retired_pages_double_bit is None
        assert d.unavailable["retired_pages_double_bit"] == "Not Supported (3)"


def test_health_command(standin, rng, capsys):
    want = script(standin, rng, 2)
    for d in (0, 1):  # a healthy pair first
        for name in FIELDS:
            if "uncorrected" in name or name in ("remap_pending", "remap_failure",
                                                 "retired_pages_pending", "recovery_action",
                                                 "remapped_rows_uncorrectable",
                                                 "retired_pages_double_bit"):
                standin.standin_set(d, name.encode(), 0)
                want[d][name] = False if name in FLAGS else 0
        standin.standin_set(d, b"ecc_mode_current", 1)
        want[d]["ecc_mode_current"] = True
    assert cli.main(["health", "--library", standin.path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["available"] and len(doc["devices"]) == 2
    for d, values in zip(doc["devices"], want):
        assert {k: d[k] for k in values} == values
    assert cli.main(["health", "--library", standin.path]) == 0
    out = capsys.readouterr().out
    assert "GPU health" in out and "Stand-in GPU 1" in out and "ok" in out
    standin.standin_set(1, b"sram_volatile_uncorrected", 1)
    assert cli.main(["health", "--library", standin.path]) == 1
    assert "sram_volatile_uncorrected = 1" in capsys.readouterr().out
    assert cli.main(["health", "--library", standin.path, "--watch", "0.02", "--count", "3",
                     "--json"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(json.loads(x)["available"] for x in lines)
    assert cli.main(["health", "--library", "/nonexistent/libnvml.so"]) == 0
    assert "unavailable" in capsys.readouterr().out


def test_monitor_reports_events_and_counter_increases(standin):
    standin.standin_reset(2)
    m = Monitor(standin.path, poll_seconds=0.02)
    try:
        assert m.available
        for _ in range(500):
            if m.events_status == "":
                break
            time.sleep(0.002)
        assert m.events_status == "" and "driver events on" in m.status()
        wait_for_a_reading(standin)
        standin.standin_event(1, 0x8, 48)
        standin.standin_event(0, 0x8, 79)
        standin.standin_set(1, b"dram_volatile_corrected", 1)
        got = wait_for(m, 3)
        assert len(got) == 3
        xid48, xid79 = [e for e in got if e.kind == "xid"]
        assert (xid48.device, xid48.describe(), xid48.fatal) == (1, "Xid 48 (double-bit ECC error)", False)
        assert (xid79.device, xid79.fatal) == (0, True)
        counter = [e for e in got if e.kind == "counter"][0]
        assert (counter.device, counter.detail) == (1, "dram_volatile_corrected 0 -> 1")
    finally:
        m.close()


# -- the recovery engine ----------------------------------------------------------------------

def trainer(name, telemetry, resume=False):
    # The stand-in's devices are the four virtual CPU devices, by position (on a GPU machine
    # too: there NVML's devices would be matched to the GPUs by UUID).
    opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
    tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=name, snapshot_every=4,
                 scrub_every=1000, telemetry=telemetry, resume=resume,
                 devices=jax.devices("cpu"))
    tr.prewarm()
    return tr


def test_a_suspect_device_is_scrubbed_at_once(standin, shm_name):
    standin.standin_reset(4)
    reference = trainer(shm_name + "r", None)
    try:
        reference.run(12)
        ref_state = reference.current_state()
    finally:
        HostBackup.unlink(shm_name + "r")
    m = Monitor(standin.path, poll_seconds=0.01)
    tr = trainer(shm_name, m)
    try:
        assert tr.stats.telemetry.startswith("watching 4 device(s)")
        tr.run(4)
        assert tr.stats.scrubs == 0 and not tr.stats.suspect_devices
        standin.standin_set(2, b"remapped_rows_correctable", 1)
        deadline = time.monotonic() + 5
        step = 4
        while not tr.stats.suspect_devices and time.monotonic() < deadline:
            time.sleep(0.03)
            step += 1
            tr.run(min(step, 12))
        assert tr.stats.suspect_devices == {2}
        tr.run(12)
        assert tr.stats.scrubs == 1  # scrub_every=1000: this one came from the telemetry
        inc = [i for i in tr.stats.incidents if i.kind is IncidentKind.TELEMETRY]
        assert len(inc) == 1 and inc[0].action is Action.SCRUBBED
        assert inc[0].detail == "device 2: remapped_rows_correctable 0 -> 1"
        # nothing else happened
        assert [i.kind for i in tr.stats.incidents] == [IncidentKind.TELEMETRY]
        assert tr.compiles == 0
        state = tr.current_state()
        assert state.keys() == ref_state.keys() and all(
            state[k].tobytes() == ref_state[k].tobytes() for k in state)
    finally:
        tr.close()


def test_a_fatal_event_stops_the_run_with_the_way_to_resume(standin, shm_name):
    standin.standin_reset(4)
    m = Monitor(standin.path, poll_seconds=0.01)
    tr = trainer(shm_name, m)
    try:
        tr.run(9)  # snapshots at 0, 4 and 8
        for _ in range(500):
            if m.events_status == "":
                break
            time.sleep(0.002)
        standin.standin_event(1, 0x8, 79)
        time.sleep(0.3)
        with pytest.raises(DeviceFailure) as err:
            tr.run(20)
        assert err.value.device == 1 and err.value.snapshot_step == 8
        assert "Xid 79 (GPU has fallen off the bus)" in str(err.value)
        assert "resume from the host snapshot of step 8" in str(err.value)
    finally:
        tr.close()
    again = trainer(shm_name, None, resume=True)
    assert again.next_step == 9
    again.run(12)
    assert again.stats.steps_committed == 12 - 8


def test_a_device_error_becomes_device_failure_not_a_hang(shm_name):
    import jax

    tr = trainer(shm_name, None)
    tr.run(5)

    def poisoned(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: CUDA error: uncorrectable ECC error encountered")

    for parity in (0, 1):
        tr.programs.step[parity] = poisoned
    with pytest.raises(DeviceFailure) as err:
        tr.run(8)
    assert "uncorrectable ECC error" in str(err.value)
    assert "resume from the host snapshot of step 4" in str(err.value)
    assert err.value.snapshot_step == 4
    tr.close()  # as the process's end would: the region is free for the resuming run
    again = trainer(shm_name, None, resume=True)
    assert again.next_step == 5
    again.run(8)
    assert again.stats.steps_committed == 4

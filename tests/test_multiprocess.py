"""One process per device group, the way clusters run: two processes on a localhost
coordinator (jax.distributed), each with two CPU devices, one replica each. With
PIMHBM_MULTIPROCESS_PLATFORM=gpu (scripts/gpu-check --multi) each process drives one GPU."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from pimhbm.backup import HostBackup

HERE = os.path.dirname(__file__)
PLATFORM = os.environ.get("PIMHBM_MULTIPROCESS_PLATFORM", "cpu")
TIMEOUT_S = float(os.environ.get("PIMHBM_MULTIPROCESS_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport,copy", [("collective", "copy"), ("ipc", "copy"),
                                            ("collective", "no-copy")])
def test_two_processes_repair_across_processes_and_end_bit_identical(tmp_path, transport, copy):
    """The double fault is repaired from the other process's replica: by a collective, or by a
    CUDA IPC pull -- on GPUs; elsewhere IPC is unavailable, said once, and the collective
    transport takes over. Without device copies the single flip comes from the replica too.
    A lost shard (more damage than the fault list holds) is rebuilt whole from the other
    replica through the same transport."""
    if PLATFORM == "cpu" and (transport, copy) == ("collective", "copy"):
        pytest.skip("on CPUs the 'ipc' case runs this same collective path (IPC is unavailable "
                    "there), and says so")
    shm = f"pimhbm_test_{uuid.uuid4().hex[:10]}"
    out = str(tmp_path / "result.json")
    port = str(free_port())
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    if PLATFORM == "cpu":  # not this suite's four devices: two per process
        env.pop("XLA_FLAGS", None)
        env["JAX_PLATFORMS"] = "cpu"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py"),
                               str(i), "2", port, shm, out, PLATFORM, transport, copy], env=env,
                              stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
             for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        late = [p for p in procs if p.poll() is None]
        for p in late:  # its Python stacks (faulthandler), then it is stopped
            p.send_signal(signal.SIGABRT)
        for p in late:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for i in range(2):
            HostBackup.unlink(f"{shm}.p{i}")
    logs = [f.read_text() for f in logs]
    if late:
        pytest.fail(f"the two-process run did not finish in {TIMEOUT_S:.0f} s:\n" + "\n".join(
            f"--- process {i}:\n{log[-6000:]}" for i, log in enumerate(logs)))
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    r = json.load(open(out))
    assert r["platform"] == PLATFORM
    assert [len(row) for row in r["devices"]] == ([2, 2] if PLATFORM == "cpu" else [1, 1])
    failed = [what for what, ok in r["checks"].items() if not ok]
    assert not failed, (failed, r["incidents"])
    assert len(r["checks"]) == 10
    replica_repairs = 1 if copy == "copy" else 2
    assert r["replica_repairs"] == replica_repairs and r["host_restores"] == 1
    assert r["replica_rebuilds"] == 1
    assert r["compiles"] == 0
    notes = [i for i in r["incidents"] if i[1] == "replica transport"]
    if transport == "ipc" and PLATFORM == "gpu":
        assert r["ipc_pulls"] == replica_repairs + r["chunks_per_device"] and not notes, \
            r["incidents"]
    elif transport == "ipc":
        assert r["ipc_pulls"] == 0 and len(notes) == 1 and "CUDA IPC unavailable" in notes[0][3]
    else:
        assert r["ipc_pulls"] == 0 and not notes

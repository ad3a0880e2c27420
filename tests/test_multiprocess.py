"""One process per device group, the way clusters run: two processes on a localhost
coordinator (jax.distributed), each with two CPU devices, one replica each."""

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

from pimhbm.backup import HostBackup

HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_repair_across_processes_and_end_bit_identical(tmp_path):
    shm = f"pimhbm_test_{uuid.uuid4().hex[:10]}"
    out = str(tmp_path / "result.json")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py"),
                               str(i), "2", port, shm, out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two-process run did not finish in 600 s")
    finally:
        for i in range(2):
            HostBackup.unlink(f"{shm}.p{i}")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    r = json.load(open(out))
    # A 2 x 2 mesh; the worker checked that process 0 holds replica 0, process 1 replica 1.
    assert [len(row) for row in r["devices"]] == [2, 2]
    assert r["reference_incidents"] == 0
    by_step = {}
    for step, kind, locations, action in r["incidents"]:
        by_step.setdefault(step, []).append((kind, locations, action))
    kind, locations, action = by_step[4][0]
    assert locations == [[1, "w1", "nu", 1000 // 256]]
    assert action == "repaired from a healthy replica (device 3)"  # the other process
    kind, locations, action = by_step[8][0]
    assert locations == [[2, "w0", "p", 77 // 256]] and action == "repaired from the device copy"
    assert by_step[11][0][0] == "gradient"
    assert by_step[14][0][2].startswith("restored from host snapshot @")
    assert r["replica_repairs"] == 1 and r["host_restores"] == 1
    assert r["compiles"] == 0
    assert r["identical"], "the run under faults did not end as the fault-free run"

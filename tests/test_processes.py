"""The tools' jax.distributed coordinator listens on loopback only, not on every interface."""

import socket
import subprocess
import sys

import pytest

LISTENER = """
import argparse, sys
import jax
from pimhbm_cli import processes
port, bound = int(sys.argv[1]), sys.argv[2] == "bound"
if bound:  # as the tools start it
    processes.join(argparse.Namespace(coordinator=f"localhost:{port}", processes=1, process_id=0,
                                      devices=1))
else:  # the plain call, for the control
    jax.distributed.initialize(f"localhost:{port}", 1, 0, initialization_timeout=60)
want = f"{port:04X}"
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and local.rsplit(":", 1)[1] == want:  # LISTEN on the port
            print("listening", local.rsplit(":", 1)[0])
jax.distributed.shutdown()
"""

LOOPBACK = {"0100007F", "00000000000000000000000001000000",  # 127.0.0.1, ::1
            "0000000000000000FFFF00000100007F"}  # ::ffff:127.0.0.1
ANY = {"00000000", "00000000000000000000000000000000"}


def listening(bound: bool) -> set[str]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", LISTENER, str(port), "bound" if bound else "plain"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {line.split()[1] for line in r.stdout.splitlines() if line.startswith("listening")}


def test_the_coordinator_listens_on_loopback_only():
    if sys.platform != "linux":
        pytest.skip("reads /proc/net")
    bound = listening(bound=True)
    assert bound and bound <= LOOPBACK, bound
    assert listening(bound=False) & ANY  # the control: without the bind, every interface

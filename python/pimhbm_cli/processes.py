"""One process per device group on this host, the way clusters run a job: the launcher starts
copies of the command, each joins the others through ``jax.distributed`` on a localhost
coordinator."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from typing import Any


def gpu_count() -> int:
    """GPUs on this machine, asked of nvidia-smi (the launcher must not start a JAX backend)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def launch(args: Any) -> int:
    """Starts ``args.processes`` copies of this command (``args.argv``), each with its process
    id and the coordinator's address, and waits for all of them; the exit code is the worst of
    theirs. On CPUs each process makes its share of ``args.devices`` virtual devices."""
    n = args.processes
    if args.devices % n:
        print(f"--devices {args.devices} must split evenly over --processes {n}", file=sys.stderr)
        return 2
    gpus = gpu_count()
    if gpus and gpus < args.devices:
        print(f"--devices {args.devices}: this machine has {gpus} GPUs", file=sys.stderr)
        return 2
    with socket.socket() as s:  # a free port for the coordinator, on loopback only
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if not gpus:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count="
                                             f"{args.devices // n}"])
    procs = [subprocess.Popen([sys.executable, "-m", "pimhbm_cli", *args.argv, "--process-id",
                               str(i), "--coordinator", f"localhost:{port}"], env=env)
             for i in range(n)]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def join(args: Any) -> None:
    """In a process the launcher started: jax.distributed, this process's GPUs (or, on CPUs,
    gloo collectives over its virtual devices). The coordinator listens on the address it was
    given (loopback), not on every interface."""
    import jax

    if args.process_id is None:
        return
    where = dict(coordinator_address=args.coordinator, coordinator_bind_address=args.coordinator,
                 num_processes=args.processes, process_id=args.process_id,
                 initialization_timeout=120)
    if gpu_count():
        per = args.devices // args.processes
        jax.distributed.initialize(**where, local_device_ids=list(
            range(args.process_id * per, (args.process_id + 1) * per)))
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**where)

"""One process of a two-process run (jax.distributed on a localhost coordinator, two CPU devices
each, gloo collectives): the protected trainer on a 2 replicas x 2 shards mesh whose replicas
are the two processes. Runs the fault-free reference, then the same run under faults that need
another process's replica, the device copy and each process's own host snapshot; process 0
writes what it saw to the JSON file named on the command line.

usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT SHM_NAME OUT.json"""

import json
import os
import sys

pid, nproc, port, shm, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", nproc, pid, initialization_timeout=120)

import pimhbm  # noqa: E402
from pimhbm import faults  # noqa: E402
from pimhbm.models import mlp  # noqa: E402
from pimhbm.recovery import Trainer  # noqa: E402

STEPS = 20
opt = pimhbm.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
tr = Trainer(mlp.loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm, snapshot_every=5,
             scrub_every=5, inject_gradients=True, shard=2, telemetry=None)
assert [d.process_index for d in tr.mesh.devices[:, 0]] == [0, 1], "a replica per process"
tr.prewarm()
ref_stats = tr.run(STEPS)
ref = tr.current_state()


class Faults:
    def before_step(self, trainer, step, attempt):
        if attempt != 1:
            return None
        if step == 4:  # state and copy of device 1 (process 0): from device 3 (process 1)
            for copy in (False, True):
                trainer.inject("w1", "nu", faults.spec(faults.FLIP_BIT, offset=4 * 1000, bit=6),
                               into_copy=copy, device=1)
        if step == 8:  # device 2 only (process 1), state only: its own device copy
            trainer.inject("w0", "p", faults.spec(faults.FLIP_BIT, offset=2 * 77, bit=3), device=2)
        if step == 11:  # a NaN in a gradient on every device
            return [0] + list(faults.spec(faults.NONFINITE, offset=5, value="nan"))
        if step == 14:  # the same flip in state and copy everywhere: each process's snapshot
            for copy in (False, True):
                trainer.inject("b1", "mu", faults.spec(faults.FLIP_BIT, offset=8, bit=1),
                               into_copy=copy)
        return None

    def before_scrub(self, trainer, step):
        pass


tr.restart(mlp.init(0))
stats = tr.run(STEPS, campaign=Faults())
state = tr.current_state()
result = {
    "process": pid,
    "devices": [[d.id for d in row] for row in tr.mesh.devices],
    "reference_incidents": len(ref_stats.incidents),
    "identical": sorted(state) == sorted(ref) and all(
        state[k].tobytes() == ref[k].tobytes() for k in state),
    "incidents": [(i.step, i.kind, [list(l) for l in i.locations], i.action)
                  for i in stats.incidents],
    "replica_repairs": stats.replica_repairs,
    "host_restores": stats.host_restores,
    "compiles": tr.compiles,
}
tr.close(unlink=True)
if pid == 0:
    with open(out, "w") as f:
        json.dump(result, f)
jax.distributed.shutdown()

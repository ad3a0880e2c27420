"""One process of a two-process run (jax.distributed on a localhost coordinator, two CPU devices
each, gloo collectives): the protected trainer on a 2 replicas x 2 shards mesh whose replicas
are the two processes. Runs the fault-free reference, then the same run under faults that need
another process's replica, the device copy and each process's own host snapshot; process 0
writes what it saw to the JSON file named on the command line.

On GPUs (PLATFORM gpu) each process drives one GPU and the mesh is 2 replicas x 1 shard.
The worker checks what it saw itself and exits 1 on any failed check.

usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT SHM_NAME OUT.json [cpu|gpu]"""

import json
import logging
import os
import sys
import time

T0 = time.monotonic()
logging.basicConfig(format="%(relativeCreated)9.0f ms %(name)s: %(message)s")
logging.getLogger("pimhbm.ipc").setLevel(logging.DEBUG)


def progress(what: str) -> None:  # seen when the test prints a run that did not finish
    print(f"[{time.monotonic() - T0:7.1f} s] process {sys.argv[1]}: {what}", flush=True)


pid, nproc, port, shm, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
platform = sys.argv[6] if len(sys.argv) > 6 else "cpu"
transport = sys.argv[7] if len(sys.argv) > 7 else "collective"
# "copy": the state has a device copy; "no-copy": none, every damaged chunk from the replica.
DEVICE_COPY = (sys.argv[8] if len(sys.argv) > 8 else "copy") == "copy"
if platform == "cpu":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

if platform == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", nproc, pid, initialization_timeout=120,
                               coordinator_bind_address=f"localhost:{port}")
else:
    jax.distributed.initialize(f"localhost:{port}", nproc, pid, local_device_ids=[pid],
                               initialization_timeout=120,
                               coordinator_bind_address=f"localhost:{port}")

progress("jax.distributed initialised")
import pimhbm  # noqa: E402
from pimhbm import faults  # noqa: E402
from pimhbm.models import mlp  # noqa: E402
from pimhbm.recovery import Action, IncidentKind, Trainer  # noqa: E402

STEPS = 20
opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=DEVICE_COPY, chunk_elems=256)
shard = 2 if platform == "cpu" else 1
seen_batch_rows = []  # the batch rows one device computes on, as the step is traced


def loss(params, batch):
    seen_batch_rows.append(batch["x"].shape[0])
    return mlp.loss(params, batch)


global_rows = mlp.batches(0)(0)["x"].shape[0]
# A fault list of 16 chunks a device: w1 wiped at step 17 (18 chunks of a device's shard on
# CPUs, 36 on a GPU) overflows it, so that device's whole state is rebuilt.
tr = Trainer(loss, opt, mlp.init(0), mlp.batches(0), shm_name=shm, snapshot_every=5,
             scrub_every=5, inject_gradients=True, shard=shard, telemetry=None,
             replica_transport=transport, fault_capacity=16)
assert [d.process_index for d in tr.mesh.devices[:, 0]] == [0, 1], "a replica per process"
n = len(tr.devices)
DOUBLE = 1  # state and copy damaged: repaired from the same shard of the other replica
SOURCE = (1 - DOUBLE // shard) * shard + DOUBLE % shard
SINGLE = n - 2  # state only: its own device copy (without one: the other replica)
SINGLE_SOURCE = (1 - SINGLE // shard) * shard + SINGLE % shard
COPIES = (False, True) if DEVICE_COPY else (False,)
tr.prewarm()
progress("prewarmed")
ref_stats = tr.run(STEPS)
ref = tr.current_state()
progress("fault-free run done")


class Faults:
    seen = 0  # incidents already printed

    def before_step(self, trainer, step, attempt):
        progress(f"step {step}, attempt {attempt}")
        for i in trainer.stats.incidents[self.seen:]:
            progress(f"incident at step {i.step}: {i.kind}: {i.describe()}")
        self.seen = len(trainer.stats.incidents)
        if attempt != 1:
            return None
        if step == 4:
            for copy in COPIES:
                trainer.inject("w1", "nu", faults.spec(faults.FLIP_BIT, offset=4 * 1000, bit=6),
                               into_copy=copy, device=DOUBLE)
        if step == 8:
            trainer.inject("w0", "p", faults.spec(faults.FLIP_BIT, offset=2 * 77, bit=3),
                           device=SINGLE)
        if step == 11:  # a NaN in a gradient on every device
            return faults.GradientFault(0, faults.spec(faults.NONFINITE, offset=5, value="nan"))
        if step == 14:  # the same flip in state and copy everywhere: each process's snapshot
            for copy in COPIES:
                trainer.inject("b1", "mu", faults.spec(faults.FLIP_BIT, offset=8, bit=1),
                               into_copy=copy)
        if step == 17:  # a lost shard: more damaged chunks than the fault list holds
            for tensor in trainer.names:
                for copy in COPIES:
                    trainer.inject("w1", tensor, faults.spec(faults.WIPE, seed=5),
                                   into_copy=copy, device=DOUBLE)
        return None

    def before_scrub(self, trainer, step):
        pass


tr.restart(mlp.init(0))
stats = tr.run(STEPS, campaign=Faults())
progress("run under faults done")
state = tr.current_state()
by_step = {}
for i in stats.incidents:
    by_step.setdefault(i.step, []).append(i)
checks = {
    "each device computes its part of the batch":
        bool(seen_batch_rows) and set(seen_batch_rows) == {global_rows // n},
    "fault-free run reports nothing": not ref_stats.incidents,
    "double fault located": by_step[4][0].locations == ((DOUBLE, "w1", "nu", 1000 // 256),),
    "double fault from the other replica":
        by_step[4][0].action is Action.REPAIRED_FROM_REPLICA and by_step[4][0].sources == (SOURCE,),
    "single flip repaired": by_step[8][0].locations == ((SINGLE, "w0", "p", 0),) and (
        by_step[8][0].action is Action.REPAIRED_FROM_DEVICE_COPY if DEVICE_COPY else
        by_step[8][0].action is Action.REPAIRED_FROM_REPLICA and
        by_step[8][0].sources == (SINGLE_SOURCE,)),
    "NaN gradient skipped": by_step[11][0].kind is IncidentKind.GRADIENT,
    "everywhere: host snapshot": by_step[14][0].action is Action.RESTORED_FROM_SNAPSHOT,
    "lost shard rebuilt from the other replica":
        by_step[17][0].action is Action.REBUILT_FROM_REPLICA and
        by_step[17][0].sources == (SOURCE,) and
        {loc.device for loc in by_step[17][0].locations} == {DOUBLE},
    "no compilation after prewarm": tr.compiles == 0,
    "bit-identical": sorted(state) == sorted(ref) and all(
        state[k].tobytes() == ref[k].tobytes() for k in state),
}
result = {
    "process": pid,
    "platform": platform,
    "checks": checks,
    "devices": [[d.id for d in row] for row in tr.mesh.devices],
    "reference_incidents": len(ref_stats.incidents),
    "identical": sorted(state) == sorted(ref) and all(
        state[k].tobytes() == ref[k].tobytes() for k in state),
    "incidents": [(i.step, i.kind, [list(l) for l in i.locations], i.describe())
                  for i in stats.incidents],
    "replica_repairs": stats.replica_repairs,
    "replica_rebuilds": stats.replica_rebuilds,
    "chunks_per_device": int(sum(tr.nchunks)) * len(tr.names),
    "ipc_pulls": stats.ipc_pulls,
    "host_restores": stats.host_restores,
    "compiles": tr.compiles,
}
tr.close(unlink=True)
if pid == 0:
    with open(out, "w") as f:
        json.dump(result, f)
for what, ok in checks.items():
    print(f"process {pid}: {what}: {'ok' if ok else 'FAILED'}")
jax.distributed.shutdown()
sys.exit(0 if all(checks.values()) else 1)

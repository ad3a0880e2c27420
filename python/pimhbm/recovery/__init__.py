"""The recovery engine: train under protection, locate every fault, repair it in place, replay.

Each step runs one compiled program that computes the gradients, updates the state and leaves
a small fault summary on the device. The state is held once and updated in place
(:mod:`pimhbm.inplace`: parity over groups of chunks is the redundancy) or in two slots with a
device copy (:class:`pimhbm.update.AdamW`: programs per slot parity); either way digests are checked
and rewritten in the update's own pass. The host fetches the summary asynchronously and acts
one step later, so the steady-state loop never waits for the device.

A step that saw damage before its update commits nothing; one copy's update that finds damage
itself leaves those chunks unwritten. Either way the *halt* flag it sets on the device makes
every step after it commit nothing, so that nothing is applied out of order. When the host
learns of it, it repairs the damaged chunks in place (rebuilt from parity and their update
redone, from the device copy, a healthy replica, or the newest host snapshot in shared memory),
clears the halt flag and replays the skipped steps from the batch log, with the same compiled
programs.

The modules, in the order a fault travels through them (ARCHITECTURE.md draws it):

* ``layout`` -- which chunk of which tensor of which device; the Damage bits;
* ``placement`` -- the mesh, the shardings, host <-> device;
* ``traced`` (with ``one_copy`` and ``two_slots``, the two kinds of state) and ``programs`` --
  the functions the engine compiles, compiled ahead of time;
* ``summary`` -- the step's summary on the device, decoded on the host into a fault report;
* ``planner`` -- which chunk comes from where (pure);
* ``transports`` and ``repairs`` -- the repair, through one ReplicaTransport protocol;
* ``snapshots`` -- host snapshots (orbax's verbs) and the batch log;
* ``health`` -- the GPUs' own signals between steps;
* ``events`` -- incidents, statistics, and the errors that end a run;
* ``handling`` -- what the loop does with a fault report;
* ``trainer`` -- the loop.
"""

from pimhbm.recovery.events import (Action, DeviceFailure, Incident, IncidentKind,
                                    PersistentFault, RunStats)
from pimhbm.recovery.layout import ChunkRef, Damage
from pimhbm.recovery.placement import Transport, fsdp_spec
from pimhbm.recovery.traced import TrainState
from pimhbm.recovery.trainer import Trainer

__all__ = ["Action", "ChunkRef", "Damage", "DeviceFailure", "Incident", "IncidentKind",
           "PersistentFault", "RunStats", "Trainer", "TrainState", "Transport",
           "fsdp_spec"]

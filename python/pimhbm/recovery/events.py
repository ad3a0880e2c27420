"""What a run reports: incidents (each written once, with what was done about it), the run's
statistics, and the two errors that end a run."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any

import jax
import numpy as np

from pimhbm.recovery.layout import ChunkRef

log = logging.getLogger("pimhbm.recovery")


class IncidentKind(enum.StrEnum):
    STATE = "state"  # state chunks whose digest did not match
    # NaN/Inf gradient values (two slots: elements whose gradient or new values are not finite,
    # which its update counts as one -- eps 0 with zero moments, an overflow, too)
    GRADIENT = "gradient"
    # one copy: new values the update found non-finite and kept as they were (the step was
    # applied in part: eps 0 with zero moments, an overflow), or a learning rate or bias
    # correction that could not make finite values (the update applied nothing)
    UPDATE = "non-finite update"
    # one copy, the gradients checked in the update: a loss that was not finite held the step
    # before any write (and nothing else found explains it)
    LOSS = "non-finite loss"
    DISAGREEMENT = "replicas disagree"  # chunks that differ between replicas, digests and all
    COMPUTE = "compute"  # gradients computed again (sampled re-execution) came out different
    DEVICE_COPY = "device copy"  # device-copy chunks a scrub found damaged
    PARITY = "parity"  # parity rows a scrub found out of step with their groups (one copy)
    TELEMETRY = "telemetry"  # news from the GPU's own signals (NVML)
    TRANSPORT = "replica transport"  # a replica transport that failed or is unavailable


class Action(enum.Enum):
    """What the engine did about an incident."""

    REPAIRED_FROM_DEVICE_COPY = "repaired from the device copy"
    REPAIRED_FROM_PARITY = "rebuilt from its parity group"
    REDONE_FROM_PARITY = "rebuilt from its parity group, its update redone"
    REPAIRED_FROM_REPLICA = "repaired from a healthy replica"
    REBUILT_FROM_REPLICA = "rebuilt whole from a healthy replica"
    RESTORED_FROM_SNAPSHOT = "restored from host snapshot"
    SKIPPED_AND_REPLAYED = "step skipped, replayed"
    DEVICE_COPY_REPAIRED = "device copy repaired from the current state"
    DEVICE_COPY_NOT_REPAIRED = "device copy repair failed"
    PARITY_REMADE = "parity made anew from the state"
    PARITY_KEPT = "parity kept: a chunk of its group is damaged, the next step rebuilds it"
    SCRUBBED = "full scrub"  # a suspect device's state checked at once
    COLLECTIVE_FROM_NOW_ON = "the collective transport from now on"
    HOST_SNAPSHOT_INSTEAD = "falling back to the host snapshot"

    @property
    def repaired(self) -> bool:
        """Whether the damage is gone (state as it was before the fault)."""
        return self in _REPAIRED


_REPAIRED = {Action.REPAIRED_FROM_DEVICE_COPY, Action.REPAIRED_FROM_PARITY,
             Action.REDONE_FROM_PARITY, Action.REPAIRED_FROM_REPLICA,
             Action.REBUILT_FROM_REPLICA, Action.RESTORED_FROM_SNAPSHOT,
             Action.SKIPPED_AND_REPLAYED, Action.DEVICE_COPY_REPAIRED, Action.PARITY_REMADE}


@dataclasses.dataclass(frozen=True)
class Incident:
    """One fault the engine handled: where, and what it did about it."""

    step: int
    kind: IncidentKind
    locations: tuple[ChunkRef, ...]
    action: Action
    sources: tuple[int, ...] = ()  # devices the repaired chunks came from (replica repairs)
    snapshot_step: int | None = None  # RESTORED_FROM_SNAPSHOT: the snapshot's step
    detail: str = ""  # what the device or transport said (telemetry, transport incidents)
    devices: tuple[int, ...] = ()  # COMPUTE: the devices whose gradients came out different
    # GRADIENT: more chunks held NaN/Inf than the summary lists (typically a damaged parameter
    # upstream made the whole gradient non-finite); the locations are then a prefix
    unlisted: bool = False

    def describe(self) -> str:
        """The action in words, with its specifics (for logs and tables)."""
        text = self.action.value
        if self.action is Action.REBUILT_FROM_REPLICA:
            devices = ", ".join(map(str, sorted({loc.device for loc in self.locations})))
            text = f"device {devices} {text}"
        if self.sources:
            text += f" (device {', '.join(map(str, self.sources))})"
        if self.snapshot_step is not None:
            text += f" @{self.snapshot_step}"
        return f"{self.detail}; {text}" if self.detail else text

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the enums by their value, each location as a mapping."""
        return {"step": self.step, "kind": self.kind.value, "action": self.action.value,
                "description": self.describe(),
                "locations": [loc._asdict() for loc in self.locations],
                "sources": list(self.sources), "snapshot_step": self.snapshot_step,
                "detail": self.detail, "devices": list(self.devices), "unlisted": self.unlisted}


def record(stats: "RunStats", incidents: list[Incident]) -> None:
    """Incidents into the run's statistics, each logged once as it is written: a warning where
    the damage stays, else information."""
    for inc in incidents:
        where = ", ".join(f"device {l.device} {l.leaf}/{l.tensor} chunk {l.chunk}"
                          for l in inc.locations[:3])
        more = f" and {len(inc.locations) - 3} more" if len(inc.locations) > 3 else ""
        level = logging.INFO if inc.action.repaired or inc.kind is IncidentKind.TELEMETRY else logging.WARNING
        log.log(level, "step %d: %s%s: %s", inc.step, inc.kind.value,
                f" at {where}{more}" if where else "", inc.describe())
        stats.incidents.append(inc)


@dataclasses.dataclass
class RunStats:
    steps_committed: int = 0
    steps_skipped: int = 0
    steps_replayed: int = 0
    repairs: int = 0
    host_restores: int = 0
    replica_repairs: int = 0  # chunks pulled from another device's copy of the state
    ipc_pulls: int = 0  # chunks pulled from another process's GPU over CUDA IPC (repairs, rebuilds)
    replica_rebuilds: int = 0  # devices whose whole state was rebuilt from another's
    snapshots: int = 0
    scrubs: int = 0
    compiles_after_prewarm: int = 0
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    # A loss with aux (Trainer(has_aux=True)): each committed step's, on the host (floating
    # leaves averaged over devices, integer ones summed).
    aux: dict[int, Any] = dataclasses.field(default_factory=dict)
    incidents: list[Incident] = dataclasses.field(default_factory=list)
    telemetry: str = "off"  # what the hardware telemetry watches, or why it does not
    telemetry_events: list[Any] = dataclasses.field(default_factory=list)  # TelemetryEvent
    suspect_devices: set[int] = dataclasses.field(default_factory=set)  # positions in devices

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (``json.dumps(stats.to_dict())``): losses by step (as JSON's string
        keys), incidents and telemetry events as mappings, the suspect devices sorted."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["losses"] = {str(step): float(loss) for step, loss in self.losses.items()}
        out["aux"] = {str(step): jax.tree.map(lambda a: np.asarray(a).tolist(), aux)
                      for step, aux in self.aux.items()}
        out["incidents"] = [i.to_dict() for i in self.incidents]
        out["telemetry_events"] = [dataclasses.asdict(e) if dataclasses.is_dataclass(e) else
                                   dict(e.__dict__) for e in self.telemetry_events]
        out["suspect_devices"] = sorted(self.suspect_devices)
        return out

    def to_json(self, **kwargs: Any) -> str:
        import json
        return json.dumps(self.to_dict(), **kwargs)


class DeviceFailure(RuntimeError):
    """A device failed in a way this process cannot go on from (a poisoned CUDA context, a GPU
    lost): restart the process and resume from the host snapshot in shared memory
    (``Trainer(..., shm_name=<same>, resume=True)``)."""

    def __init__(self, message: str, device: int | None, snapshot_step: int | None):
        super().__init__(message)
        self.device = device
        self.snapshot_step = snapshot_step


class PersistentFault(RuntimeError):
    """The same step was skipped on every replay: the damage comes back each time, so it is not
    a transient fault the engine can repair (a gradient that is non-finite on its own -- the
    loss diverged, bad data -- or a device that computes wrongly). ``step``, ``skips``, and the
    last skip's ``incidents``."""

    def __init__(self, message: str, step: int, skips: int, incidents: list[Incident]):
        super().__init__(message)
        self.step = step
        self.skips = skips
        self.incidents = incidents


def persistent_fault(step: int, skips: int, nonfinite: int, damaged: int,
                     incidents: list[Incident], kept: int = 0, bad_scalars: bool = False,
                     loss_nonfinite: bool = False) -> PersistentFault:
    """What to tell a user whose step never commits: ``nonfinite`` gradient values,
    ``damaged`` state chunks (or chunks the replicas disagree on), ``kept`` elements whose new
    values were not finite, (``bad_scalars``) a learning rate or bias correction that could
    not make finite values, or (``loss_nonfinite``) a loss that was not finite came back on
    the last replay."""
    what = []
    if loss_nonfinite:
        what.append("a loss that was not finite (the update applied nothing)")
    if bad_scalars:
        what.append("a learning rate or bias correction that could not make finite values "
                    "(the update applied nothing)")
    disagree = [loc for inc in incidents if inc.kind is IncidentKind.DISAGREEMENT
                for loc in inc.locations]
    if disagree:
        where = ", ".join(f"{loc.leaf}/{loc.tensor} chunk {loc.chunk}" for loc in disagree[:3])
        what.append(f"chunks the replicas disagree on ({where}, ...)")
    if nonfinite:
        grads = [loc for inc in incidents if inc.kind is IncidentKind.GRADIENT
                 for loc in inc.locations]
        where = ", ".join(f"{loc.leaf} chunk {loc.chunk}" for loc in grads[:3])
        # An update that checks the gradients itself counts their values and its own alike.
        values = "gradient values or new values" if kept else "gradient values"
        what.append(f"{nonfinite} non-finite {values}" + (f" (in {where}, ...)" if where else ""))
    elif kept:
        what.append(f"{kept} elements whose new values were not finite (kept as they were; "
                    "counted on every device that holds them)")
    if damaged:
        locs = [loc for inc in incidents if inc.kind is IncidentKind.STATE for loc in inc.locations]
        where = ", ".join(f"{loc.leaf}/{loc.tensor} chunk {loc.chunk} on device {loc.device}"
                          for loc in locs[:3])
        what.append(f"{damaged} state chunks whose digest did not match" +
                    (f" ({where}, ...)" if where else ""))
    hint = _hint(bool(nonfinite or loss_nonfinite), bool(kept or bad_scalars), bool(damaged),
                 bool(disagree))
    return PersistentFault(
        f"step {step} was skipped {skips} times in a row, every replay reporting "
        f"{' and '.join(what) or 'a fault'}. Faults are transient; this comes back on every "
        f"replay. {hint}.", step, skips, incidents)


SETTINGS_HINT = ("New values that are not finite from finite gradients come from the "
                 "optimizer's settings: a NaN or infinite learning rate or schedule value, eps 0 "
                 "where a moment is 0, or a learning rate that overflows a weight")


def _hint(nonfinite: bool, settings: bool, damaged: bool, disagree: bool) -> str:
    """Where to look, for what came back on every replay (state before values: damage makes
    values non-finite too)."""
    if damaged:
        return ("State that fails its digest again after each repair points at a device that "
                "computes or stores wrongly (see `pimhbm health`)")
    if disagree:
        return ("Replicas that keep computing different states point at a device that computes "
                "wrongly (see `pimhbm health`; the devices named are those of the chunks)")
    gradient = ("A gradient that is non-finite on its own is no fault: the loss diverged or the "
                "batch holds bad values (check the learning rate, the data and the loss)")
    if nonfinite and settings:
        return f"{gradient}. {SETTINGS_HINT}"
    return gradient if nonfinite else SETTINGS_HINT if settings else (
        "A step that is held without a reason it names points at a device that computes "
        "wrongly (see `pimhbm health`)")

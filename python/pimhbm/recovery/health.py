"""The GPUs' own signals between steps: what NVML reported since the last step (no NVML call
here; pimhbm.telemetry.Monitor watches on its own thread). A device with news becomes suspect
and is scrubbed at once; a fatal event stops the run."""

from __future__ import annotations

from typing import Any, Callable

import jax

import pimhbm
from pimhbm.recovery.events import (Action, DeviceFailure, Incident, IncidentKind, RunStats,
                                    record)


class HealthWatch:
    """``monitor``: a pimhbm.telemetry.Monitor, or None for none. ``failure(what, device)``
    makes the DeviceFailure that a fatal event raises (it says how to resume)."""

    def __init__(self, monitor: Any, devices: list[Any],
                 failure: Callable[[str, int | None], DeviceFailure]):
        self.monitor, self.failure = monitor, failure
        self.positions = self._map_nvml_devices(devices)

    def _map_nvml_devices(self, devices: list[Any]) -> dict[int, int]:
        """NVML index -> position in ``devices``: by UUID for GPUs (CUDA ordinals and NVML
        indices differ under CUDA_VISIBLE_DEVICES); else index i is position i."""
        m = self.monitor
        if m is None or not m.available:
            return {}
        by_uuid = {d.uuid: d.index for d in m.devices if d.uuid}
        cuda = pimhbm._core.cuda_device_uuids()
        out = {}
        for pos, dev in enumerate(devices):
            hw = getattr(dev, "local_hardware_id", None)
            if (dev.platform == "gpu" and dev.process_index == jax.process_index() and
                    hw is not None and hw < len(cuda) and cuda[hw] in by_uuid):
                out[by_uuid[cuda[hw]]] = pos
        if not out:
            out = {i: i for i in range(min(len(m.devices), len(devices)))}
        return out

    def status(self) -> str:
        return "off" if self.monitor is None else self.monitor.status()

    def poll(self, step: int, stats: RunStats) -> bool:
        """Records what the GPUs reported; True when a device became suspect (scrub now)."""
        if self.monitor is None:
            return False
        suspect = False
        for e in self.monitor.drain():
            pos = self.positions.get(e.device)
            stats.telemetry_events.append(e)
            where = f"device {pos}" if pos is not None else f"NVML device {e.device} (not in this run)"
            if e.fatal:
                raise self.failure(f"{where}: {e.describe()}", pos)
            if pos is None:
                continue
            stats.suspect_devices.add(pos)
            suspect = True
            record(stats, [Incident(step, IncidentKind.TELEMETRY, (), Action.SCRUBBED,
                                    detail=f"{where}: {e.describe()}")])
        return suspect

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

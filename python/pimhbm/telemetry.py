"""Hardware telemetry: the GPU's own memory-fault signals (NVML), next to pimhbm's.

``pimhbm.health()`` reads, per device, the ECC mode and error counts (in total, DRAM and SRAM;
volatile and aggregate), remapped rows, retired pages and the driver's recommended recovery
action. NVML is opened at run time: on a machine without an NVIDIA driver ``health()``
returns ``available=False`` with the reason, and nothing else changes.

:class:`Monitor` watches in the background (a C++ thread: driver events for single- and
double-bit ECC errors and Xid critical errors, and the counters re-read every
``poll_seconds``); :meth:`Monitor.drain` hands over what happened since the last call without
touching NVML, so the recovery engine calls it between steps at no measurable cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pimhbm import _core

# The fields of a reading (the C++ side's order); flags are 0/1, the rest counts.
FIELDS: tuple[str, ...] = tuple(_core.telemetry_fields())
FLAGS = ("ecc_mode_current", "ecc_mode_pending", "remap_pending", "remap_failure",
         "retired_pages_pending")

RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain peer-to-peer traffic",
                    4: "drain and reset", 5: "GPU reset (bus)"}

# Xids after which this process's CUDA context cannot be trusted to go on (the GPU fell off
# the bus; an uncontained ECC error). Other events make the device *suspect*: its state is
# scrubbed at once, and a real failure then shows as a device error on the next step.
FATAL_XIDS = {79: "GPU has fallen off the bus", 95: "uncontained ECC error"}
XID_MEANINGS = {48: "double-bit ECC error", 63: "row remapping / page retirement recorded",
                64: "row remapping / page retirement failed", 92: "high single-bit ECC error rate",
                94: "contained ECC error", **FATAL_XIDS}


@dataclasses.dataclass(frozen=True)
class DeviceHealth:
    """One device's reading; a field is None where the GPU or driver does not report it
    (``unavailable`` says why)."""

    index: int
    name: str
    uuid: str
    ecc_mode_current: bool | None
    ecc_mode_pending: bool | None
    ecc_volatile_corrected: int | None
    ecc_volatile_uncorrected: int | None
    ecc_aggregate_corrected: int | None
    ecc_aggregate_uncorrected: int | None
    dram_volatile_corrected: int | None
    dram_volatile_uncorrected: int | None
    dram_aggregate_corrected: int | None
    dram_aggregate_uncorrected: int | None
    sram_volatile_corrected: int | None
    sram_volatile_uncorrected: int | None
    sram_aggregate_corrected: int | None
    sram_aggregate_uncorrected: int | None
    remapped_rows_correctable: int | None
    remapped_rows_uncorrectable: int | None
    remap_pending: bool | None
    remap_failure: bool | None
    retired_pages_single_bit: int | None
    retired_pages_double_bit: int | None
    retired_pages_pending: bool | None
    recovery_action: int | None
    unavailable: dict[str, str]

    @property
    def concerns(self) -> list[str]:
        """What in this reading deserves attention (empty for a healthy device)."""
        out = []
        for f in ("ecc_volatile_uncorrected", "dram_volatile_uncorrected",
                  "sram_volatile_uncorrected", "remapped_rows_uncorrectable",
                  "retired_pages_double_bit"):
            if getattr(self, f):
                out.append(f"{f} = {getattr(self, f)}")
        for f in ("remap_pending", "remap_failure", "retired_pages_pending"):
            if getattr(self, f):
                out.append(f)
        if self.recovery_action:
            out.append(f"recovery action: {RECOVERY_ACTIONS.get(self.recovery_action, self.recovery_action)}")
        if self.ecc_mode_current is False:
            out.append("ECC is off")
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Health:
    available: bool
    reason: str  # why not, when not available
    library: str
    devices: list[DeviceHealth]

    def as_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "library": self.library,
                "devices": [d.as_dict() for d in self.devices]}


@dataclasses.dataclass(frozen=True)
class TelemetryEvent:
    device: int  # NVML index (-1: not tied to a device)
    kind: str  # single_bit_ecc, double_bit_ecc, xid, counter, gpu_lost, error
    xid: int
    detail: str
    seconds: float  # since the monitor started

    @property
    def fatal(self) -> bool:
        """The CUDA context of this process cannot go on after it."""
        return self.kind == "gpu_lost" or (self.kind == "xid" and self.xid in FATAL_XIDS)

    def describe(self) -> str:
        if self.kind == "xid" and self.xid in XID_MEANINGS:
            return f"Xid {self.xid} ({XID_MEANINGS[self.xid]})"
        return self.detail


def _device(d: dict) -> DeviceHealth:
    fields = {}
    for name in FIELDS:
        v = d["fields"][name]
        fields[name] = (bool(v) if v is not None else None) if name in FLAGS else v
    return DeviceHealth(index=d["index"], name=d["name"], uuid=d["uuid"], **fields,
                        unavailable=dict(d["unavailable"]))


def health(library: str | None = None) -> Health:
    """One reading of every device NVML sees. ``library``: NVML's path (default
    libnvidia-ml.so.1, or $PIMHBM_NVML_LIBRARY)."""
    t = _core.Telemetry(library or "")
    return Health(t.available, t.reason, t.library, [_device(d) for d in t.read()])


class Monitor:
    """Watches the GPUs in the background; :meth:`drain` returns what happened since the last
    call (no NVML call on the caller's thread). Inactive, with :attr:`reason`, without NVML."""

    def __init__(self, library: str | None = None, poll_seconds: float = 1.0):
        self._t = _core.Telemetry(library or "")
        self.poll_seconds = poll_seconds
        self.devices = [_device(d) for d in self._t.read()] if self._t.available else []
        if self._t.available:
            self._t.start(poll_seconds)

    @property
    def available(self) -> bool:
        return self._t.available

    @property
    def reason(self) -> str:
        return self._t.reason

    @property
    def events_status(self) -> str:
        """'' while driver events are watched, else why not (counters are polled anyway)."""
        return self._t.events_status if self._t.available else self._t.reason

    def status(self) -> str:
        if not self.available:  # the reason's first clause; .reason has all of it
            return f"unavailable: {self.reason.split(' (')[0]}"
        ev = self.events_status
        return (f"watching {len(self.devices)} device(s): counters every {self.poll_seconds:g} s, "
                + ("driver events on" if ev == "" else f"driver events off ({ev})"))

    def drain(self) -> list[TelemetryEvent]:
        if not self._t.available:
            return []
        return [TelemetryEvent(**e) for e in self._t.drain()]

    def close(self) -> None:
        self._t.stop()

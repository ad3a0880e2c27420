"""``pimhbm health``: the GPUs' own memory-fault signals, read through NVML.

Per device: ECC mode; corrected and uncorrected ECC errors (volatile: since the driver loaded;
aggregate: over the GPU's life), in total and for DRAM and SRAM; remapped rows; retired pages;
the driver's recommended recovery action. A field the GPU or driver does not report shows as
"-" (``--json`` says why). Exit code 1 when a device shows uncorrected errors, a pending or
failed remap, pending page retirement or a recovery action; 0 otherwise, also when there is no
NVML on this machine (then the reason is printed).
"""

from __future__ import annotations

import json
import time
from typing import Any

from pimhbm_cli import options
from pimhbm_cli.options import positive_float, positive_int


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document per reading")
    p.add_argument("--watch", type=positive_float, default=None, metavar="N",
                   help="read again every N seconds, and list driver events as they come "
                        "(Ctrl-C ends)")
    p.add_argument("--library", default=None,
                   help="NVML's path (default libnvidia-ml.so.1, or $PIMHBM_NVML_LIBRARY)")
    p.add_argument("--count", type=positive_int, default=None,
                   help="with --watch: stop after this many readings")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _table(h):
    from rich.table import Table

    from pimhbm.telemetry import RECOVERY_ACTIONS

    t = Table(title=f"GPU health (NVML: {h.library})")
    t.add_column("")
    for d in h.devices:
        t.add_column(f"{d.index}: {d.name}", justify="right")
    rows = [("ECC on (pending)", lambda d: f"{_cell(d.ecc_mode_current)} ({_cell(d.ecc_mode_pending)})")]
    for scope in ("volatile", "aggregate"):
        for where, label in (("ecc", "all"), ("dram", "DRAM"), ("sram", "SRAM")):
            rows.append((f"ECC {scope} {label}: corrected / uncorrected",
                         lambda d, s=scope, w=where: f"{_cell(getattr(d, f'{w}_{s}_corrected'))} / "
                                                     f"{_cell(getattr(d, f'{w}_{s}_uncorrected'))}"))
    rows += [
        ("remapped rows: correctable / uncorrectable",
         lambda d: f"{_cell(d.remapped_rows_correctable)} / {_cell(d.remapped_rows_uncorrectable)}"),
        ("remap pending / failed", lambda d: f"{_cell(d.remap_pending)} / {_cell(d.remap_failure)}"),
        ("retired pages: single-bit / double-bit",
         lambda d: f"{_cell(d.retired_pages_single_bit)} / {_cell(d.retired_pages_double_bit)}"),
        ("page retirement pending", lambda d: _cell(d.retired_pages_pending)),
        ("recovery action", lambda d: "-" if d.recovery_action is None
         else RECOVERY_ACTIONS.get(d.recovery_action, str(d.recovery_action))),
        ("verdict", lambda d: "[red]" + "; ".join(d.concerns) + "[/]" if d.concerns else "[green]ok[/]"),
    ]
    for label, fn in rows:
        t.add_row(label, *[fn(d) for d in h.devices])
    return t


def _print(console, h) -> None:
    console.print(_table(h))
    for d in h.devices:  # the concerns again, unwrapped, for logs and grep
        if d.concerns:
            console.print(f"device {d.index} ({d.name}): " + "; ".join(d.concerns), soft_wrap=True)


def run(args: Any) -> int:

    from pimhbm.telemetry import Monitor, health

    console = options.console()
    h = health(args.library)
    if not h.available:
        if args.json:
            print(json.dumps(h.as_dict()))
        else:
            console.print(f"hardware telemetry unavailable: {h.reason}")
        return 0
    if args.watch is None:
        if args.json:
            print(json.dumps(h.as_dict()))
        else:
            _print(console, h)
        return 1 if any(d.concerns for d in h.devices) else 0

    monitor = Monitor(args.library, poll_seconds=max(args.watch, 0.05))
    if not args.json:
        console.print(monitor.status())
    readings = 0
    try:
        while True:
            h = health(args.library)
            events = monitor.drain()
            readings += 1
            if args.json:
                print(json.dumps({**h.as_dict(), "time": time.time(),
                                  "events": [e.__dict__ for e in events]}), flush=True)
            else:
                _print(console, h)
                for e in events:
                    console.print(f"  event: device {e.device}: {e.describe()}")
            if args.count is not None and readings >= args.count:
                break
            time.sleep(args.watch)
    except KeyboardInterrupt:
        pass
    finally:
        monitor.close()
    return 1 if any(d.concerns for d in h.devices) else 0

"""``pimhbm recover``: the fault campaign on a data-parallel state (a copy on every device; with
``--shard N`` each replica's parameters split over N devices, FSDP), faults injected into single
devices' copies or shards, and the collective fault map as (device, tensor,
chunk) triples -- each repaired (from the device's own device copy, or, for a double fault,
from a healthy replica on another device), the run ending as the run without faults."""

from __future__ import annotations

import uuid
from typing import Any

from pimhbm_cli import options
from pimhbm_cli.options import non_negative_int, positive_int


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=60, help="training steps")
    p.add_argument("--faults", type=non_negative_int, default=4, help="faults of each kind")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="how many of the devices to use (default: all)")
    p.add_argument("--shard", type=positive_int, default=1,
                   help="devices each replica's parameters are split over (FSDP)")
    p.add_argument("--replica-transport", choices=("collective", "peer"), default="collective",
                   help="how a chunk travels from a healthy replica")


def _per_device_campaign(trainer: Any, counts: dict, steps: int, seed: int, devices: int):
    """The campaign of every kind, each state fault on one device's copy or shard (a double
    fault's state and device-copy halves on the same device)."""
    import numpy as np

    from pimhbm.campaign import Campaign

    class PerDevice(Campaign):
        def before_step(self, trainer, step, attempt):
            if attempt != 1:
                return None
            inject, chosen = trainer.inject, {}

            def one_device(path, tensor, fault, device=None, **k):
                # The campaign names a device where the fault must be on one (a double
                # fault's two halves); the others go to one device of our choosing.
                key = (path, tensor, tuple(np.asarray(fault).tolist()))
                if device is None:
                    device = chosen.setdefault(key, int(self.rng.integers(devices)))
                return inject(path, tensor, fault, device=device, **k)

            trainer.inject = one_device
            try:
                return super().before_step(trainer, step, attempt)
            finally:
                trainer.inject = inject

    return PerDevice(trainer, counts, last_step=steps, seed=seed)


def _print_fault_map(console, stats: Any) -> None:
    from rich.table import Table

    table = Table(title="the collective fault map: (device, tensor, chunk) -> what was done")
    for col in ("step", "kind", "(device, tensor, chunk)", "action"):
        table.add_column(col)
    for inc in stats.incidents:
        triples = ", ".join(f"({d}, {p}/{t}, {c})" for d, p, t, c in inc.locations[:4])
        more = f" +{len(inc.locations) - 4}" if len(inc.locations) > 4 else ""
        table.add_row(str(inc.step), str(inc.kind), triples + more, inc.describe())
    console.print(table)


def run(args: Any) -> int:
    import jax

    import pimhbm
    from pimhbm.backup import HostBackup
    from pimhbm.campaign import KINDS
    from pimhbm.models import mlp
    from pimhbm.recovery import Trainer

    console = options.console()
    devices = jax.devices()
    if args.devices is not None:
        if args.devices > len(devices):
            console.print(f"[red]--devices {args.devices}: there are {len(devices)}[/]")
            return 2
        devices = devices[:args.devices]
    if len(devices) % args.shard:
        console.print(f"[red]--shard {args.shard} must divide the {len(devices)} devices[/]")
        return 2
    name = f"pimhbm_recover_{uuid.uuid4().hex[:8]}"

    def trainer():
        opt = pimhbm.update.adamw(3e-3, master_weights=True, device_copy=True, chunk_elems=256)
        t = Trainer(mlp.loss, opt, mlp.init(args.seed), mlp.batches(args.seed, batch=16 * len(devices)),
                    shm_name=name, snapshot_every=10, scrub_every=5, inject_gradients=True,
                    shard=args.shard, replica_transport=args.replica_transport, devices=devices)
        t.prewarm()
        return t

    try:
        ref = trainer()
        ref.run(args.steps)
        ref_state = ref.current_state()
        ref.close(unlink=True)
        tr = trainer()
        campaign = _per_device_campaign(tr, {k: args.faults for k in KINDS}, args.steps,
                                        args.seed + 1, len(devices))
        stats = tr.run(args.steps, campaign=campaign)
        state = tr.current_state()
    finally:
        HostBackup.unlink(name)

    console.print(f"{len(devices)} device(s) as {len(devices) // args.shard} replica(s) x "
                  f"{args.shard} shard(s); {len(campaign.plan)} faults over {args.steps} steps "
                  "(chunk indices are local to the device's shard)")
    _print_fault_map(console, stats)
    found = campaign.check(stats)
    identical = all(state[k].tobytes() == ref_state[k].tobytes() for k in state)
    console.print(f"detected {sum(r['detected'] for r in found.values())}/"
                  f"{sum(r['injected'] for r in found.values())}, repaired "
                  f"{sum(r['repaired'] for r in found.values())}; compilations after prewarm "
                  f"{tr.compiles}; final state " +
                  ("[green]bit-identical[/] to the run without faults" if identical else "[red]DIFFERENT[/]"))
    console.print(f"chunks repaired from the device copy {stats.repairs - stats.replica_repairs}; "
                  f"from a healthy replica {stats.replica_repairs}; devices rebuilt whole from a "
                  f"replica {stats.replica_rebuilds}; restores from the host snapshot "
                  f"{stats.host_restores}")
    ok = identical and all(r["missed"] == 0 for r in found.values()) and tr.compiles == 0
    return 0 if ok else 1

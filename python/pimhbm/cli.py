"""The ``pimhbm`` command: the main job (demo) and the tools."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimhbm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job: train a Llama-3 twice, with and without a "
                                       "fault campaign, and show the runs end bit-identical")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--faults", type=int, default=12, help="faults of each kind (default 12)")
    demo.add_argument("--kinds", nargs="*", default=None,
                      help="fault kinds (default: all of param_flip master_flip moment_flip "
                           "row_burst grad_nonfinite double_fault)")
    demo.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    demo.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    demo.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    demo.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--out", default="demo-out", help="folder for metrics.json and loss.png")
    demo.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")

    scan = sub.add_parser("scan-demo", help="damage a model-sized pytree, find every fault by "
                                            "its chunk digests")
    scan.add_argument("--hidden", type=int, default=512)
    scan.add_argument("--layers", type=int, default=4)
    scan.add_argument("--vocab", type=int, default=8192)
    scan.add_argument("--flips", type=int, default=32)
    scan.add_argument("--nonfinite", type=int, default=6)
    scan.add_argument("--chunk-bytes", type=int, default=None)
    scan.add_argument("--seed", type=int, default=0)
    scan.add_argument("--device", default=None)

    from pimhbm.tools import gate, health, llama3, recover, shard

    tools = {"gate": (gate, "prewarm from shapes, and the insulation gate on injected NaN/Inf"),
             "shard": (shard, "a mesh over the devices, the state sharded, per-shard digests"),
             "recover": (recover, "the fault campaign on a data-parallel state, with the "
                                  "collective fault map as (device, tensor, chunk)"),
             "llama3": (llama3, "Llama-3-8B-dimension layers under protection: step time "
                                "protected vs unprotected, and a fault campaign"),
             "health": (health, "the GPUs' own memory-fault signals (NVML): ECC counts, "
                                "remapped rows, retired pages, Xid events")}
    for name, (module, help_text) in tools.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))

    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # to start copies of itself
    if args.command in ("demo", "recover") or (args.command == "llama3" and args.deterministic):
        # Exact replay needs a deterministic step: on GPUs XLA's default attention and some
        # reductions are not bit-repeatable. Set before JAX starts its backends (harmless on
        # CPUs); its own cost is not the cost of protection.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_deterministic_ops" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_deterministic_ops=true").strip()
    if args.command == "demo":
        from pimhbm import demo as module
    elif args.command == "scan-demo":
        from pimhbm import scan_demo as module
    else:
        module = tools[args.command][0]
    from pimhbm.recovery import DeviceFailure, PersistentFault
    try:
        return module.run(args)
    except (PersistentFault, DeviceFailure) as err:
        # The run cannot go on; the message says why and what to do: no traceback.
        print(f"pimhbm {args.command}: stopped: {err}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())

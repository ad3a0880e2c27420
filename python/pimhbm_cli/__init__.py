"""The ``pimhbm`` command: the main job (demo) and the tools, each a module of this package with
``add_arguments(parser)`` and ``run(args) -> exit code``. The library is ``pimhbm``; nothing
here is its API."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pimhbm_cli import options

# name -> (module, one line of help); `pimhbm NAME --help` shows the module's docstring too
COMMANDS = {
    "demo": ("demo", "the main job: train a Llama-3 twice, with and without a fault campaign, "
                     "and show the runs end bit-identical"),
    "scan-demo": ("scan_demo", "damage a model-sized pytree, find every fault by its chunk "
                               "digests"),
    "gate": ("gate", "prewarm from shapes, and the insulation gate on injected NaN/Inf"),
    "shard": ("shard", "a mesh over the devices, the state sharded, per-shard digests"),
    "recover": ("recover", "the fault campaign on a data-parallel state, with the collective "
                           "fault map as (device, tensor, chunk)"),
    "llama3": ("llama3", "Llama-3-8B-dimension layers under protection: step time protected vs "
                         "unprotected, and a fault campaign"),
    "health": ("health", "the GPUs' own memory-fault signals (NVML): ECC counts, remapped rows, "
                         "retired pages, Xid events"),
}


def _module(name: str):
    return importlib.import_module(f"pimhbm_cli.{COMMANDS[name][0]}")


def _needs_exact_replay(args: argparse.Namespace) -> bool:
    """Whether the command's exact replays need XLA's deterministic flag: not where the model's
    attention is pimhbm's (the demo's and llama3's models, when their head dim is one our
    kernels take); `recover` (its small MLP's steps on several devices) sets it still."""
    from pimhbm.attention import HEAD_DIMS
    from pimhbm.models import llama3

    if args.command == "demo":
        try:
            return llama3.tiny(hidden=args.hidden).head_dim not in HEAD_DIMS
        except ValueError:  # a width the model refuses: the demo says so itself
            return False
    if args.command == "llama3":
        return args.deterministic and args.tiny and llama3.tiny().head_dim not in HEAD_DIMS
    return args.command == "recover"


def _parser() -> argparse.ArgumentParser:
    import pimhbm

    parser = argparse.ArgumentParser(prog="pimhbm", description=options.plain(__doc__),
                                     formatter_class=options.HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pimhbm {pimhbm.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        module = _module(name)
        module.add_arguments(sub.add_parser(name, help=help_text,
                                            description=options.plain(module.__doc__),
                                            formatter_class=options.HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # to start copies of itself
    if _needs_exact_replay(args):
        # Exact replay needs a deterministic step: on GPUs XLA's default attention and some
        # reductions are not bit-repeatable. Set before JAX starts its backends (harmless on
        # CPUs); its own cost is not the cost of protection.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_deterministic_ops" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_deterministic_ops=true").strip()
    from pimhbm.recovery import DeviceFailure, PersistentFault
    try:
        return _module(args.command).run(args)
    except (PersistentFault, DeviceFailure) as err:
        # The run cannot go on; the message says why and what to do: no traceback.
        print(f"pimhbm {args.command}: stopped: {err}", file=sys.stderr)
        return 3
